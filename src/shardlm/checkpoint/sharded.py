"""The per-rank checkpoint format written by `shardlm shard` and `shardlm reshard`.

    OUT/
      shardlm.json                  written last: the commit record (format, layout, dtype, source, files)
      config.json, tokenizer files  copied from the source, so OUT is a complete model folder
      rank-00000/
        model-00001-of-00002.safetensors ...   this rank's slices, under the checkpoint's tensor names
        model.safetensors.index.json           Hugging Face index; metadata.shardlm_slices gives each
                                               tensor's full shape and the [start, stop) it holds

A folder without shardlm.json is not a checkpoint (an interrupted write leaves exactly that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.headers import INDEX_NAME

INFO_NAME = "shardlm.json"
FORMAT = "shardlm-per-rank"
VERSION = 1


def rank_dir_name(rank: int) -> str:
    """Folder of one rank's files, e.g. rank-00003."""
    return f"rank-{rank:05d}"


def is_sharded(folder: Path) -> bool:
    """True for a folder written by `shardlm shard` (it has shardlm.json)."""
    return (Path(folder) / INFO_NAME).is_file()


def looks_interrupted(folder: Path) -> bool:
    """True for a folder with rank files or temporary files but no shardlm.json (a killed write)."""
    folder = Path(folder)
    return not is_sharded(folder) and any(folder.glob("rank-*"))


@dataclass(frozen=True)
class ShardedInfo:
    """What shardlm.json records."""

    tp: int
    stage_layers: tuple[tuple[int, int], ...]
    dtype: str
    source: dict
    ranks: list[dict]
    """Per rank: {"rank", "stage", "tp_rank", "dir", "files": {name: {"bytes", "sha256"}}}."""
    plan: dict | None = None
    """The manifest the files were written for (as parsed YAML), when one was given."""

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.stage_layers)

    def describe(self) -> str:
        """e.g. "tp 2 x pp 2 (layers 0-15, 15-30)"."""
        ranges = ", ".join(f"{a}-{b}" for a, b in self.stage_layers)
        return f"tp {self.tp} x pp {self.pp} (layers {ranges})"

    def to_json(self) -> dict:
        """The shardlm.json document."""
        return {"format": FORMAT, "version": VERSION, "layout": {"tp": self.tp, "pp": self.pp,
                "stage_layers": [list(r) for r in self.stage_layers]}, "dtype": self.dtype,
                "source": self.source, "plan": self.plan, "ranks": self.ranks}


def read_info(folder: Path) -> ShardedInfo:
    """Parse OUT/shardlm.json; CheckpointError naming the file and field when it is malformed."""
    path = Path(folder) / INFO_NAME
    if not path.is_file():
        hint = " (an interrupted write: rerun the command with --overwrite)" if looks_interrupted(folder) else ""
        raise CheckpointError(f"{folder} has no {INFO_NAME}, so it is not a per-rank checkpoint{hint}")
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format is {doc.get('format')!r}, expected {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise CheckpointError(f"{path}: version {doc.get('version')} is not supported (this shardlm reads "
                                  f"{VERSION}); rewrite it with this version's `shardlm reshard`")
        lay = doc["layout"]
        return ShardedInfo(int(lay["tp"]), tuple((int(a), int(b)) for a, b in lay["stage_layers"]), str(doc["dtype"]),
                           dict(doc["source"]), list(doc["ranks"]), doc.get("plan"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is malformed ({type(e).__name__}: {e}); rewrite it with `shardlm shard`") from e


def read_rank_index(folder: Path, rank: int) -> tuple[Path, dict[str, dict]]:
    """(rank folder, {tensor: {"shape", "slices"}}) for global `rank` of a per-rank checkpoint."""
    info = read_info(folder)
    if not 0 <= rank < len(info.ranks):
        raise CheckpointError(f"{folder} holds files for {len(info.ranks)} ranks ({info.describe()}) but rank {rank} "
                              "asked for its own; reshard it for this plan with `shardlm reshard`")
    rank_dir = rank_folder(folder, info.ranks[rank], rank)
    index = rank_dir / INDEX_NAME
    try:
        slices = json.loads(index.read_text())["metadata"]["shardlm_slices"]
    except FileNotFoundError as e:
        raise CheckpointError(f"{index} is missing; the per-rank checkpoint is incomplete") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a per-rank index (needs metadata.shardlm_slices): {e}") from e
    return rank_dir, slices


def rank_folder(folder: Path, record: object, rank: int) -> Path:
    """The folder shardlm.json names for `rank`, refused (CheckpointError) unless it lies inside `folder`."""
    from shardlm.checkpoint.contain import inside

    where = f"{Path(folder) / INFO_NAME} (rank {rank}'s \"dir\")"
    if not isinstance(record, dict) or not isinstance(record.get("dir"), str):
        raise CheckpointError(f"{where} is missing or not a folder name; rewrite the checkpoint with `shardlm shard`")
    return inside(folder, record["dir"], where)


def check_layout(folder: Path, tp: int, stage_layers: tuple[tuple[int, int], ...], n_layers: int) -> None:
    """Raise CheckpointError unless the per-rank files were written for this tp and these stages."""
    info = read_info(folder)
    want = tuple(stage_layers) or ((0, n_layers),)
    if info.tp != tp or info.stage_layers != want:
        ranges = ", ".join(f"{a}-{b}" for a, b in want)
        raise CheckpointError(f"{folder} holds per-rank files for {info.describe()}, but this run is tp {tp} x pp "
                              f"{len(want)} (layers {ranges}); run `shardlm reshard {folder} --manifest NEW.yaml -o OUT` "
                              "for this plan, or run the plan the files were written for")
