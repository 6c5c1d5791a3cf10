"""`shardlm serve`: a long-lived engine behind an OpenAI-compatible HTTP API (serve/)."""

from __future__ import annotations

import logging
from typing import Optional

import typer

from shardlm.checkpoint.integrity import DEFAULT_VERIFY
from shardlm.cli import layout as L
from shardlm.cli import options as o
from shardlm.cli.common import err, fail
from shardlm.engine.checks import UserError
from shardlm.plan.plan import KVBudget
from shardlm.settings import Settings

DEFAULT_PREFILL_CHUNK = 512
"""Prompt tokens a serving step prefills when neither --prefill-chunk nor a manifest says. Measured with
bench/serve.py (16 streams of 64-token prompts, bundled model, 2 cores): 512 served 4-10 % more output tokens/s
than 256 in each of 5 alternating pairs, with lower TTFT p99 and inter-token p99 (two prefill steps a wave of 16
prompts, not four); vLLM's CPU server budgets 2048 tokens a step."""


def serve(
    model: L.Model = None,
    manifest: L.Manifest = None,
    tp: L.Tp = None,
    pp: L.Pp = None,
    layers: L.Layers = None,
    micro_batches: L.MicroBatches = None,
    dtype: L.Dtype = None,
    quantization: L.Quantization = None,
    quantize_embedding: L.QuantizeEmbedding = False,
    memory_budget: L.MemoryBudget = None,
    offload_dir: L.OffloadDir = None,
    no_prefetch: L.NoPrefetch = False,
    device: L.Device = None,
    verify: L.Verify = DEFAULT_VERIFY,
    host: Optional[str] = typer.Option(None, "--host", help="Address to listen on (default 127.0.0.1, or the manifest's serving.host)."),
    port: Optional[int] = typer.Option(None, "--port", parser=o.PORT, help="TCP port (default 8000, or the manifest's serving.port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/*."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients ask for (default: the model folder's name)."),
    max_queue: int = typer.Option(256, "--max-queue", parser=o.MAX_QUEUE, help="Requests that may wait for a slot; more are answered 429."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", parser=o.MAX_BATCH, help="KV-cache slots: sequences decoded together (default 16; a manifest's kv_cache.max_batch)."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", parser=o.MAX_SEQ_LEN, help="Prompt + generated tokens per sequence (default min(model, 2048))."),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", parser=o.PREFILL_CHUNK, help="Prompt tokens prefilled per step beside running decodes (default 512; smaller stalls running streams for less time a step, larger prefills faster)."),
    decode_run: int = typer.Option(1, "--decode-run", parser=o.DECODE_RUN, help="Decode tokens a stream may get from one step while no prompt waits (same tokens; fewer messages per token, but tokens arrive in bursts and a new request waits for the run under way)."),
    drain_s: float = typer.Option(30.0, "--drain-s", parser=o.DRAIN_S, help="On SIGTERM, how long requests in flight may take to finish."),
    allow_imbalance: bool = typer.Option(False, "--allow-imbalance", help="Serve a plan whose predicted stage times are out of balance (more than the plan's limit apart)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="No request metrics or rank polling (/metrics answers 404); for measuring what monitoring costs."),
    metrics_interval_s: float = typer.Option(5.0, "--metrics-interval-s", parser=o.METRICS_INTERVAL_S, help="How often /metrics gathers the ranks' memory, traffic and step times (0: never)."),
) -> None:
    """Serve the model over HTTP (OpenAI API) until SIGTERM or Ctrl-C; exits 0 after draining."""
    from shardlm.engine.service import Engine
    from shardlm.engine.session import plan_run
    from shardlm.serve.app import Service
    from shardlm.serve.server import ServeError, bind, serve as run

    lay = L.layout_of(tp, pp, layers, micro_batches, dtype, quantization, memory_budget, offload_dir, no_prefetch,
                      device, manifest, verify, quantize_embedding)
    if lay.manifest is not None and any(v is not None for v in (max_batch, max_seq_len, prefill_chunk)):
        fail(f"--max-batch, --max-seq-len and --prefill-chunk cannot be combined with --manifest {manifest}, whose "
             "kv_cache section sizes the cache; drop them or edit the manifest")
    host, port = _address(host, port, lay)
    try:
        sock = bind(host, port)
    except ServeError as e:
        fail(str(e))
    try:
        given = lay.given | ({"max_seq_len"} if max_seq_len is not None else set())
        plan, source = plan_run(model, lay.flags, _kv(max_batch, max_seq_len, prefill_chunk), given, lay.verify,
                                lay.manifest)
        check_serveable(plan, allow_imbalance)
    except UserError as e:
        sock.close()
        fail(str(e))
    settings = Settings.from_env(log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    engine = Engine(plan, source, settings, max_queue=max_queue, decode_run=decode_run)
    name = served_model_name or _model_name(source.folder)
    err.print(f"serving {name} on http://{host}:{port} (tp={plan.layout.tp} pp={plan.layout.pp}, "
              f"{plan.kv.max_batch} slots x {plan.kv.max_seq_len} tokens); loading...", highlight=False)
    raise typer.Exit(run(Service(engine, name, api_key, metrics_interval_s=metrics_interval_s, metrics=not no_metrics), sock, drain_s))


def check_serveable(plan, allow_imbalance: bool) -> None:
    """UserError for a plan over its memory budget, or out of balance unless `allow_imbalance`: a service
    is checked before it starts, not found slow later."""
    from shardlm.plan.validate import balance_violations, memory_violations

    problems = memory_violations(plan) + ([] if allow_imbalance else
                                          [p + "; or serve it anyway with --allow-imbalance"
                                           for p in balance_violations(plan)])
    if problems:
        raise UserError(f"the plan cannot be served as it is: {problems[0]}")


def _address(host: str | None, port: int | None, lay: L.Layout) -> tuple[str, int]:
    serving = lay.manifest[0].serving if lay.manifest is not None else None
    return (host or (serving.host if serving else "127.0.0.1"), port or (serving.port if serving else 8000))


def _kv(max_batch: int | None, max_seq_len: int | None, prefill_chunk: int | None) -> KVBudget:
    seq = max_seq_len or 2048
    return KVBudget(max_batch or 16, seq, min(seq, prefill_chunk or DEFAULT_PREFILL_CHUNK))


def _model_name(folder: str) -> str:
    from pathlib import Path

    return Path(folder).name
