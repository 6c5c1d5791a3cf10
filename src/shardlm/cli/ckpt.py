"""`shardlm shard`, `reshard`, `consolidate`, `convert`, `verify`: the checkpoint commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from shardlm.checkpoint.headers import CheckpointError
from shardlm.cli import options as o
from shardlm.cli.common import out
from shardlm.cli.common import fail as _fail
from shardlm.checkpoint.integrity import DEFAULT_VERIFY, VERIFY_HELP
from shardlm.models.args import ModelConfigError

SIZE_HELP = "Largest data file, e.g. 2GB or 500MB (GB means GiB)."
DTYPES = ("float32", "bfloat16", "float16")


def _model_folder(model: str) -> Path:
    from shardlm import bundled

    try:
        return Path(bundled.resolve_model(model))
    except bundled.BundledModelError as e:
        _fail(str(e))


def _dtype(dtype: Optional[str]) -> Optional[str]:
    if dtype is not None and dtype not in DTYPES:
        _fail(f"--dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    return dtype


def _layout_from_manifest(path: str, model: Path) -> tuple[int, tuple[tuple[int, int], ...], dict]:
    """tp, stage ranges and the parsed document of a manifest; exits with one line when it is malformed or was
    made for another model than `model` (its architecture, parameters or layers differ)."""
    import yaml

    from shardlm.checkpoint.contain import check_folder_entries
    from shardlm.manifest import ManifestError, check_model, read_manifest
    from shardlm.plan.make import load_model

    try:
        plan = read_manifest(path)
        check_folder_entries(model)  # nothing outside the folder is read, config.json included
        check_model(plan, load_model(str(model))[0], path)
    except (ManifestError, CheckpointError, ModelConfigError) as e:
        _fail(str(e))
    lay = plan.layout
    return lay.tp, tuple(lay.stage_layers), yaml.safe_load(Path(path).read_text())


def _done(stats, what: str, dest: str) -> None:
    out.print(f"{what}: {stats.files} files, {stats.bytes_written / 1e6:.0f} MB in {stats.seconds:.1f} s "
              f"({stats.mb_per_s:.0f} MB/s) -> {dest}; check it with `shardlm verify {dest}`", highlight=False)


def _run(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except (CheckpointError, ModelConfigError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.strerror or e}: {e.filename or ''}; nothing was committed (no index or shardlm.json written)")


def shard(model: str = typer.Argument(..., parser=o.ModelPath(), help="Model folder (or smollm2-135m for the bundled model), ordinary or per-rank files."),
          manifest: str = typer.Option(..., "--manifest", parser=o.ExistingPath("file"), help="Plan whose ranks get files (from `shardlm plan`)."),
          output: str = typer.Option(..., "-o", "--output", parser=o.NewPath("folder"), help="Output folder (new or empty)."),
          max_shard_size: int = typer.Option("2GB", parser=o.SHARD_SIZE, help=SIZE_HELP),
          dtype: Optional[str] = typer.Option(None, help="Store weights as float32, bfloat16 or float16 (default: as stored)."),
          overwrite: bool = typer.Option(False, "--overwrite", help="Replace the checkpoint in a non-empty output folder."),
          verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
          as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Write per-rank safetensors files for a plan: each rank's slices (TP and PP), size-capped, indexed."""
    from shardlm.checkpoint.shard import shard as do_shard

    folder = _model_folder(model)
    tp, stages, doc = _layout_from_manifest(manifest, folder)
    stats = _run(do_shard, folder, Path(output), tp, stages, max_shard_size, _dtype(dtype),
                 overwrite, not as_json, doc, verify=verify)
    _report(stats, "sharded", output, as_json)


def reshard(source: str = typer.Argument(..., parser=o.ExistingPath("folder"), help="Per-rank files written by `shardlm shard`."),
            manifest: str = typer.Option(..., "--manifest", parser=o.ExistingPath("file"), help="The new plan."),
            output: str = typer.Option(..., "-o", "--output", parser=o.NewPath("folder"), help="Output folder (new or empty)."),
            max_shard_size: int = typer.Option("2GB", parser=o.SHARD_SIZE, help=SIZE_HELP),
            overwrite: bool = typer.Option(False, "--overwrite", help="Replace the checkpoint in a non-empty output folder."),
            verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
            as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Rewrite per-rank files for another plan, one tensor slice at a time (no consolidated copy in memory)."""
    from shardlm.checkpoint.sharded import is_sharded
    from shardlm.checkpoint.shard import shard as do_shard

    if not is_sharded(Path(source)):
        _fail(f"{source} holds no per-rank files (no shardlm.json); use `shardlm shard {source} --manifest ...`")
    tp, stages, doc = _layout_from_manifest(manifest, Path(source))
    stats = _run(do_shard, Path(source), Path(output), tp, stages, max_shard_size, None, overwrite, not as_json,
                 doc, verify=verify)
    _report(stats, "resharded", output, as_json)


def consolidate(source: str = typer.Argument(..., parser=o.ExistingPath("folder"), help="Per-rank files written by `shardlm shard`."),
                output: str = typer.Option(..., "-o", "--output", parser=o.NewPath("folder"), help="Output folder (new or empty)."),
                max_shard_size: int = typer.Option("2GB", parser=o.SHARD_SIZE, help=SIZE_HELP),
                dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: as stored)."),
                overwrite: bool = typer.Option(False, "--overwrite", help="Replace the checkpoint in a non-empty output folder."),
                verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
                as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Join per-rank files back into a standard Hugging Face checkpoint (size-capped shards + index)."""
    from shardlm.checkpoint.sharded import is_sharded
    from shardlm.checkpoint.shard import write_whole

    if not is_sharded(Path(source)):
        _fail(f"{source} holds no per-rank files (no shardlm.json); it is already an ordinary checkpoint "
              "(use `shardlm convert` to re-cap its files)")
    stats = _run(write_whole, Path(source), Path(output), max_shard_size, _dtype(dtype), overwrite,
                 not as_json, "consolidating", verify=verify)
    _report(stats, "consolidated", output, as_json)


def convert(model: str = typer.Argument(..., parser=o.ModelPath(), help="Hugging Face model folder (or smollm2-135m for the bundled model)."),
            output: str = typer.Option(..., "-o", "--output", parser=o.NewPath("folder"), help="Output folder (new or empty)."),
            max_shard_size: int = typer.Option("1GB", parser=o.SHARD_SIZE, help=SIZE_HELP),
            dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: as stored)."),
            quantization: Optional[str] = typer.Option(None, "--quantization", help="Store linear weights as int8 (per channel) or int4 (groups of 32)."),
            overwrite: bool = typer.Option(False, "--overwrite", help="Replace the checkpoint in a non-empty output folder."),
            verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
            as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Rewrite a checkpoint as size-capped safetensors shards with an index (what Accelerate's save_model
    does), optionally with int8/int4 linear weights that `generate` loads as they are."""
    if quantization not in (None, "none", "int8", "int4"):  # before the import below, which brings in torch
        _fail(f"--quantization {quantization} is not supported; use int8 or int4")
    from shardlm.checkpoint.shard import write_whole

    stats = _run(write_whole, _model_folder(model), Path(output), max_shard_size, _dtype(dtype), overwrite,
                 not as_json, "converting", None if quantization in (None, "none") else quantization, verify=verify)
    _report(stats, "converted", output, as_json)


def verify(folder: str = typer.Argument(..., parser=o.ExistingPath("folder"), help="A checkpoint written by shard, reshard, consolidate or convert."),
           no_checksums: bool = typer.Option(False, "--no-checksums", help="Skip the sha256 of every file (headers, sizes and coverage only)."),
           as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Check headers, sizes, checksums and that every tensor slice the plan needs is there; exit 2 if not."""
    from shardlm.checkpoint.verify import verify as do_verify

    rep = do_verify(folder, checksums=not no_checksums)
    if as_json:
        print(json.dumps({"folder": rep.folder, "kind": rep.kind, "ok": rep.ok, "problems": rep.problems,
                          "files": rep.files, "bytes": rep.bytes, "tensors": rep.tensors, "checked": rep.checked}))
    elif rep.ok:
        out.print(f"ok: {folder}: {rep.kind}; {rep.files} files, {rep.bytes / 1e6:.0f} MB, {rep.tensors or 'all'} "
                  f"tensor slices checked; {rep.checked}", highlight=False)
    else:
        from rich.markup import escape

        for p in rep.problems[:20]:
            out.print(f"[bold red]problem:[/] {escape(p)}", highlight=False, soft_wrap=True)
        if len(rep.problems) > 20:
            out.print(f"... and {len(rep.problems) - 20} more")
    if not rep.ok:
        raise typer.Exit(2)


def _report(stats, what: str, dest: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"output": dest, "files": stats.files, "bytes": stats.bytes_written, "seconds": stats.seconds,
                          "mb_per_s": stats.mb_per_s}))
    else:
        _done(stats, what, dest)
