"""`shardlm perplexity`: what a dtype or a weight quantization costs in quality, on a fixed text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from shardlm import bundled
from shardlm.checkpoint.headers import CheckpointError
from shardlm.cli import options as o
from shardlm.cli.common import err, out
from shardlm.cli.common import fail as _fail
from shardlm.models.args import ModelConfigError
from shardlm.models.registry import require_runnable
from shardlm.models.source import ModelSource
from shardlm.quant_spec import QuantizationError, check_kind

DTYPES = ("float32", "bfloat16")


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        _fail(f"{flag} {text} is not a comma-separated list of {', '.join(allowed)}")
    return items


def _check_device(device: str) -> None:
    """Exit with one line unless `device` is cpu, or cuda on a machine where torch sees a GPU."""
    if device not in ("cpu", "cuda"):
        _fail(f"--device {device} is not supported; use cpu or cuda")
    if device == "cuda":
        import torch

        from shardlm.parallel.launch import DeviceError, rank_device

        try:
            rank_device(device, 0, torch.cuda.device_count())
        except DeviceError as e:
            _fail(str(e))


def perplexity(
    model: Optional[str] = typer.Option(None, parser=o.ModelPath(), help="Local Hugging Face Llama-family folder (default: bundled SmolLM2-135M-Instruct)."),
    dtype: str = typer.Option("float32", help="float32, bfloat16, or several, e.g. float32,bfloat16."),
    quantization: str = typer.Option("none", "--quantization", help="none, int8, int4, or several, e.g. none,int8,int4."),
    text: Optional[str] = typer.Option(None, "--text", parser=o.ExistingPath("file"), help="UTF-8 text file to score (default: the public-domain text shipped with shardlm)."),
    window: int = typer.Option(512, parser=o.WINDOW, help="Tokens per scored window (each window is scored from scratch)."),
    device: str = typer.Option("cpu", help="cpu, or cuda (the first GPU)."),
    quantize_embedding: bool = typer.Option(False, "--quantize-embedding", help="Also score each row with the embedding (and a head tied to it) held as int8 rows, and print what that costs."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity of the model on a text for each dtype x quantization asked (one rank, on --device)."""
    from shardlm.engine.text import load_tokenizer
    from shardlm.runtime.perplexity import default_text, perplexity as run

    dtypes = _choices(dtype, DTYPES, "--dtype")
    quants = _choices(quantization, ("none", "int8", "int4"), "--quantization")
    _check_device(device)
    try:
        body = Path(text).read_text(encoding="utf-8") if text else default_text()
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--text {text}: {e}; give a readable UTF-8 text file")
    try:
        folder = bundled.resolve_model(model)
        from shardlm.checkpoint.verify import check_before_use

        check_before_use(folder)  # the checkpoint integrity check every read path runs (checkpoint/verify.py)
        source = ModelSource.open(folder)
        require_runnable(source.family, source.args)
        tok = load_tokenizer(folder)
        for q in quants:
            check_kind(q, device)
    except (bundled.BundledModelError, ModelConfigError, QuantizationError, CheckpointError) as e:
        _fail(str(e))
    rows = []
    for d in dtypes:
        for q in quants:
            for e in ("float", "int8") if quantize_embedding else ("float",):
                with err.status(f"scoring {d}{'' if q == 'none' else ' + ' + q}{', int8 embedding' * (e == 'int8')}..."):
                    try:
                        r = run(source, body, tok, d, None if q == "none" else q, window,
                                "cuda:0" if device == "cuda" else "cpu", embedding=e)
                    except (CheckpointError, ValueError) as ex:
                        _fail(str(ex))
                rows.append({"dtype": d, "quantization": q, "embedding": e, "perplexity": r.perplexity, "nll": r.nll,
                             "tokens": r.tokens, "windows": r.windows, "weight_bytes": r.weight_bytes,
                             "seconds": r.seconds})
    if as_json:
        print(json.dumps({"model": str(folder), "text": text or "shardlm/data/eval_text.txt", "window": window,
                          "results": rows}))
        return
    table = Table(title=f"perplexity of {Path(folder).name} on {text or 'the shipped text'} "
                        f"({rows[0]['tokens']} tokens, windows of {window})")
    cols = ("dtype", "quantization", *(("embedding",) if quantize_embedding else ()), "perplexity", "vs first row",
            *(("int8 embedding costs",) if quantize_embedding else ()), "weights MiB", "seconds")
    for col in cols:
        table.add_column(col, justify="left" if col in ("dtype", "quantization", "embedding") else "right")
    base = rows[0]["perplexity"]
    for i, r in enumerate(rows):
        # with --quantize-embedding each int8-embedding row follows its float-embedding twin
        cost = f"{r['perplexity'] / rows[i - 1]['perplexity'] - 1:+.2%}" if r["embedding"] == "int8" else ""
        table.add_row(r["dtype"], r["quantization"], *((r["embedding"],) if quantize_embedding else ()),
                      f"{r['perplexity']:.3f}", f"{r['perplexity'] / base - 1:+.1%}",
                      *((cost,) if quantize_embedding else ()), f"{r['weight_bytes'] / 2**20:.0f}",
                      f"{r['seconds']:.1f}")
    out.print(table)
