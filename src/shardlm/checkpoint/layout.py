"""Per-rank checkpoints: shardlm.json's layout against config.json, and each rank's files against it.

`layout_problems` checks the record itself (tp, stages covering every layer once, one entry per
rank with the stage and tp rank its position implies, distinct folders); `rank_problems` checks one
rank's index and headers against what that rank of the layout loads. Both only read headers.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.checkpoint.contain import inside
from shardlm.checkpoint.headers import INDEX_NAME, CheckpointError
from shardlm.checkpoint.reads import needed_names, param_reads, rank_meta_model
from shardlm.checkpoint.sharded import INFO_NAME, ShardedInfo
from shardlm.models.args import ModelArgs
from shardlm.parallel.stages import StageSpec
from shardlm.parallel.styles import ShardCoord

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""Safetensors dtypes a float weight may be stored as."""
FIX = "rewrite the checkpoint with `shardlm shard` (or restore shardlm.json)"


def stages_problem(stage_layers: tuple[tuple[int, int], ...], n_layers: int) -> str | None:
    """Why `stage_layers` do not cover layers 0..n_layers in order, each stage non-empty; None when they do."""
    pos = 0
    for i, (a, b) in enumerate(stage_layers):
        if a != pos or b <= a:
            return (f"{[list(r) for r in stage_layers]} do not cover layers 0..{n_layers} in order, each stage "
                    f"non-empty (stage {i} is {a}-{b})")
        pos = b
    if pos != n_layers:
        return f"end at layer {pos} but config.json has {n_layers} layers"
    return None


def layout_problems(folder: Path, info: ShardedInfo, args: ModelArgs) -> list[str]:
    """What is wrong with shardlm.json's layout itself, checked against config.json and its rank list."""
    where = Path(folder) / INFO_NAME
    problems = []
    if info.tp < 1 or info.tp > args.n_heads:
        problems.append(f"{where}: layout.tp is {info.tp}, but it must be 1..{args.n_heads} (the attention heads); {FIX}")
    stages = stages_problem(info.stage_layers, args.n_layers)
    if stages:
        problems.append(f"{where}: layout.stage_layers {stages}; {FIX}")
    if len(info.ranks) != info.tp * info.pp:
        problems.append(f"{where} lists {len(info.ranks)} ranks but tp {info.tp} x pp {info.pp} needs "
                        f"{info.tp * info.pp}; {FIX}")
    dirs = set()
    for i, rec in enumerate(info.ranks):
        want = {"rank": i, "stage": i // max(info.tp, 1), "tp_rank": i % max(info.tp, 1)}
        got = {k: rec.get(k) for k in want} if isinstance(rec, dict) else None
        if got != want:
            problems.append(f"{where}: ranks[{i}] is {got}, but position {i} in tp {info.tp} x pp {info.pp} is "
                            f"{want}; {FIX}")
        elif rec.get("dir") in dirs:
            problems.append(f"{where}: ranks[{i}] shares folder {rec.get('dir')!r} with another rank; {FIX}")
        else:
            dirs.add(rec.get("dir"))
    return problems


def _index(rank_dir: Path, rep) -> tuple[dict, dict] | None:
    """(shardlm_slices, weight_map) of a rank's index, or None after reporting why not."""
    try:
        index = json.loads((rank_dir / INDEX_NAME).read_text())
        slices, weight_map = index["metadata"]["shardlm_slices"], index["weight_map"]
        if isinstance(slices, dict) and isinstance(weight_map, dict):
            return slices, weight_map
        raise TypeError("shardlm_slices and weight_map must be objects")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        rep.problems.append(f"{rank_dir / INDEX_NAME} is unreadable ({type(e).__name__}: {e})")
        return None


def rank_problems(rank_dir: Path, rec: dict, info: ShardedInfo, family, args: ModelArgs, files: dict, rep) -> None:
    """Append to `rep.problems` what is wrong with one rank's index and headers for the recorded layout.

    `files` are the rank's opened safetensors headers by file name (those that passed their checks).
    """
    got = _index(rank_dir, rep)
    if got is None:
        return
    slices, weight_map = got
    for name, fname in weight_map.items():
        try:
            inside(rank_dir, fname, f"the index {rank_dir / INDEX_NAME} (tensor {name!r})")
        except CheckpointError as e:
            rep.problems.append(str(e))
            return
    coord = ShardCoord.for_model(args, rec["tp_rank"], info.tp)
    spec = StageSpec.of(info.stage_layers, rec["stage"]) if info.pp > 1 else None
    model = rank_meta_model(family, args, coord, spec)
    where = f"rank {rec['rank']} ({rank_dir.name})"
    for _, ck_name in needed_names(model, family):
        if ck_name not in slices:
            rep.problems.append(f"{where} lacks tensor {ck_name!r}, which it loads")
    try:
        expected = param_reads(model, family, coord, lambda n: slices[n]["shape"] if n in slices else None)
    except (ValueError, IndexError, TypeError, KeyError) as e:
        rep.problems.append(f"{where}: its slices cannot be computed from the recorded shapes ({e})")
        return
    for pname, read in expected:
        rep.tensors += 1
        if read.local_shape != tuple(model.get_parameter(pname).shape):
            rep.problems.append(f"{where}: tensor {read.name!r} has full shape {list(read.shape)}, which contradicts "
                                f"config.json")
            continue
        stored = [tuple(r) for r in slices[read.name].get("slices", [])]
        if stored != [(s.start, s.stop) for s in read.slices]:
            rep.problems.append(f"{where}: tensor {read.name!r} holds slice {stored} but the layout needs "
                                f"{read.ranges()}; the files do not match shardlm.json's layout")
            continue
        _stored_problem(rank_dir, where, read, weight_map.get(read.name), rec, files, rep)


def _stored_problem(rank_dir: Path, where: str, read, fname, rec: dict, files: dict, rep) -> None:
    """One tensor's header entry against the slice the index records for it."""
    handle = files.get(fname) if isinstance(fname, str) else None
    if handle is None:  # a file shardlm.json records but that failed its checks is reported already
        if not isinstance(fname, str) or fname not in rec["files"]:
            msg = f"{where}: its index puts tensors (e.g. {read.name!r}) in {fname!r}, a file shardlm.json does not record"
            if not any(p.startswith(msg.split(" (e.g.")[0]) and f"in {fname!r}," in p for p in rep.problems):
                rep.problems.append(msg)
        return
    info = handle.header.get(read.name)
    if info is None:
        rep.problems.append(f"{rank_dir / fname} lacks tensor {read.name!r} although the index names it")
    elif tuple(info["shape"]) != read.local_shape:
        rep.problems.append(f"{rank_dir / fname}: tensor {read.name!r} is stored as {list(info['shape'])}, "
                            f"not the {list(read.local_shape)} slice the index records; the header was altered")
    elif info["dtype"] not in FLOAT_DTYPES:
        rep.problems.append(f"{rank_dir / fname}: tensor {read.name!r} is stored as {info['dtype']}, but it is a "
                            f"float weight ({'/'.join(FLOAT_DTYPES)}); the header was altered")
