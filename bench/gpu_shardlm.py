"""bench/gpu.py's in-process system: one CUDA rank built and run by the runtime itself, with the switches its
variants turn (graphs, compile, joined products, run-ahead, the Triton decode blocks and their kernels)."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_replay import kernel_profile, replay_ms


class Shardlm:
    """One CUDA rank in this process: the runtime's own load and generate."""

    def __init__(self, folder: Path, dtype: torch.dtype, quantization=None, budget=None, prefetch=True,
                 graphs: bool = True, compile: bool = False, join: bool = True, host_inputs: bool = False,
                 ahead: bool = True, compile_mode: str | dict | None = None, gemv: bool = False,
                 gemv_attention: bool = True, pdl: bool = True, split: bool = False, argmax: bool = False):
        from shardlm.engine.session import plan_run
        from shardlm.parallel.context import ParallelContext
        from shardlm.plan.run import RunFlags
        from shardlm.runtime.build import build_rank_model
        from shardlm.settings import Settings

        from shardlm.kernels import cuda_argmax

        self.flags = (pdl, split)
        self._set_flags()
        flags = RunFlags(dtype=str(dtype).removeprefix("torch."), quantization=quantization or "none", device="cuda",
                         memory_budget=budget, prefetch=prefetch)
        plan, source = plan_run(str(folder), flags)
        self.args = source.args
        # decode steps as CUDA graph replays (runtime/cuda_graph.py) unless `graphs` is off
        settings = Settings.from_env(cuda_graphs=graphs, cuda_compile=compile, cuda_join=join, cuda_gemv=gemv)
        self.model = build_rank_model(plan.rank_spec(0), source, ParallelContext(), settings, "cuda:0")
        self.kernels = self.model.kernels.describe()
        if gemv and not gemv_attention:  # a bench-only experiment: the GEMV blocks with the module path's attention
            for layer in self.model.module.model.layers.values():
                layer.gemv_attention = False
            self.kernels += " (SDPA attention)"
        if gemv and not argmax:  # the GEMV blocks as first measured: greedy tokens by the step's own argmax
            self.model.module.greedy_pick = None
        elif argmax and self.model.graphs is not None:  # greedy tokens by kernels/cuda_argmax.py
            self.model.graphs.model.greedy_pick = cuda_argmax.greedy_pick
        graphs = self.model.graphs
        if compile_mode and graphs is not None:  # a bench-only experiment: another Inductor mode
            from shardlm.runtime.cuda_graph import decode_step
            options = {"mode": compile_mode} if isinstance(compile_mode, str) else {"options": compile_mode}
            graphs.step_fn = torch.compile(decode_step, dynamic=False, **options)
        if (host_inputs or not ahead) and graphs is not None:
            pick = graphs.decoder

            def decoder(*a, **k):
                dec = pick(*a, **k)
                if dec is not None:
                    dec.ahead = 0  # the host reads each step's token before the next replay
                    dec.advance = dec.advance and not host_inputs  # the host builds each step's inputs
                return dec
            graphs.decoder = decoder
        self.resident = self.model.resident_bytes()
        self.streamed_per_token = self.model.streamed_bytes_per_step()

    def _last_captured(self):
        """The GraphDecoder of the last generate call, or None (no graphs, or its capture failed)."""
        graphs = self.model.graphs
        dec = next(reversed(graphs.kept.values()), None) if graphs is not None else None
        return dec if dec is not None and dec.graph is not None else None

    def _set_flags(self) -> None:
        """This system's kernel switches (module settings the launches read): before anything runs its step."""
        from shardlm.kernels import cuda_attention, cuda_gemv

        cuda_gemv.PDL, cuda_attention.SPLIT = self.flags

    def replay_ms(self, n: int = 50) -> float | None:
        """GPU time of one decode step (gpu_replay.replay_ms), None without a captured graph."""
        dec = self._last_captured()
        return None if dec is None else replay_ms(dec, n)

    def kernel_profile(self, n: int = 20, top: int = 25) -> dict | None:
        """Where a decode step's GPU time goes (gpu_replay.kernel_profile), None without a captured graph."""
        dec = self._last_captured()
        self._set_flags()
        return None if dec is None else kernel_profile(dec, n, top)

    def generate(self, ids: list[int], new: int) -> list[int]:
        from shardlm.runtime.protocol import SamplingParams
        from shardlm.runtime.step import Batch, generate

        self._set_flags()
        return generate(self.model, Batch.from_lists([ids]), new, SamplingParams(), ())[0]

    def stream_stats(self) -> dict | None:
        streamer = self.model.streamer
        return streamer.stats.as_dict() if streamer else None

    def close(self) -> None:
        self.model.close()
        del self.model
        torch.cuda.empty_cache()
