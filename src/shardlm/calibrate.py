"""`shardlm calibrate`: measure this machine so CPU plans predict from facts, not defaults.

Measures, with every core: the bandwidth a decode step reaches reading weights, the FLOP/s of a
prefill-sized matmul, the fixed time per decoder layer per decode step (Python and kernel dispatch),
and the resident memory of a rank besides its weights and KV cache. Writes
$SHARDLM_HOME/calibration.json, which `hardware.cpu_spec` reads.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlm.atomic import atomic_file
from shardlm.hardware import CALIBRATION_FILE
from shardlm.paths import home as shardlm_home
from shardlm.models.presets import PRESETS
from shardlm.models.registry import args_for_config


def _median_time(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CALIBRATION_MODEL = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                     "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 256}
"""A 720 MB float32 decoder for measuring decode bandwidth: wide enough that its layers stream from
DRAM like a real model's, small vocabulary so the LM head does not dominate."""


@torch.no_grad()
def decode_bandwidth(steps: int = 8, repeat: int = 5) -> float:
    """Bytes/s of linear weights a real decode step streams: batch-1 decode of CALIBRATION_MODEL
    (random weights) through the same kernels and fused blocks as a rank, weight bytes / step time.

    Measuring the decode step itself, not a bare matrix-vector loop, counts what streaming a layer
    really costs here: a parallel region per projection group, each restarting its streams
    (measured on this VM: ~97 % of `sum()` bandwidth for one 400 MB matrix, 79-90 % for the same
    bytes as 210 layer-sized ones).
    """
    from shardlm.runtime.build import wrap_module
    from shardlm.runtime.step import Batch, Rows

    fam, args = args_for_config({**PRESETS["debug"], **CALIBRATION_MODEL})
    model = fam.model_class(args)
    model.reset_buffers()
    nbytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if name.startswith("model.layers.") and p.dim() == 2)  # before oneDNN may pack them
    rank = wrap_module(model)
    batch = Batch.from_lists([[1, 2, 3, 4, 5, 6, 7, 8]])

    def run() -> float:
        rows = Rows.for_model(rank, batch, steps + 1)
        token = rows.forward(model, batch.tokens, rows.prefill_mask())[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            token = rows.forward(model, token, rows.next_token())[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / steps

    run()  # warm up
    return nbytes / statistics.median(run() for _ in range(repeat))


def matmul_flops(n: int = 2048, rows: int = 512) -> float:
    """FLOP/s of a float32 (rows x n) @ (n x n) matmul, the shape of a prefill chunk."""
    x, w = torch.randn(rows, n), torch.randn(n, n)
    t = _median_time(lambda: F.linear(x, w), 7)
    return 2 * rows * n * n / t


def layer_overhead_s() -> float:
    """Seconds per decoder layer per decode step that do not scale with weights: tiny models of
    2 and 18 layers differ only by this fixed cost."""
    from shardlm.runtime.build import wrap_module
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.step import Batch, generate

    def step_time(n_layers: int) -> float:
        cfg = {**PRESETS["debug"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256, "num_hidden_layers": n_layers}
        fam, args = args_for_config(cfg)
        model = fam.model_class(args)
        model.reset_buffers()
        rank = wrap_module(model)
        batch = Batch.from_lists([[1, 2, 3, 4, 5, 6, 7, 8]])
        runs = []
        for _ in range(5):
            from shardlm.runtime.step import GenerationStats
            stats = GenerationStats()
            generate(rank, batch, 33, SamplingParams(), (), stats=stats)
            runs.append(stats.decode_s / stats.decode_tokens)
        return statistics.median(runs)

    return max(1e-6, (step_time(18) - step_time(2)) / 16)


def rank_runtime_bytes() -> int:
    """Peak resident bytes of a real rank minus its weights and KV cache (Python, torch, gloo, buffers)."""
    from shardlm.engine.engine import LocalEngine
    from shardlm.engine.session import model_ref
    from shardlm.models.random import write_random_checkpoint
    from shardlm.models.source import ModelSource
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags, plan_for_run
    from shardlm.runtime.protocol import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(PRESETS["debug"], Path(tmp))
        source = ModelSource.open(tmp)
        plan = plan_for_run(model_ref(source), source.family, source.args, RunFlags(), KVBudget(1, 8, 4))
        with LocalEngine(plan, source) as engine:
            result = engine.generate([[1, 2, 3, 4]], 4, SamplingParams(), ignore_eos=True)
            ready = engine.ready[0]
    return int(result.ranks[0]["peak_rss_bytes"] - ready["weight_bytes"])


def calibrate(progress=None) -> dict:
    """Run every measurement (about a minute) and return the calibration dict."""
    steps = [("bandwidth", decode_bandwidth), ("flops", matmul_flops), ("layer_overhead_s", layer_overhead_s),
             ("runtime_bytes", rank_runtime_bytes)]
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = {"cores": os.cpu_count() or 1}
    for name, fn in steps:
        if progress:
            progress(name)
        cpu[name] = fn()
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu}


def write_calibration(data: dict, home: Path | None = None) -> Path:
    """Write calibration.json atomically into $SHARDLM_HOME (or `home`)."""
    folder = Path(home or shardlm_home())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CALIBRATION_FILE
    with atomic_file(path) as f:
        json.dump(data, f, indent=2)
    return path
