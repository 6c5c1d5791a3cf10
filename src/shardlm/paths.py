"""Where shardlm keeps its files: the cache folder ``$SHARDLM_HOME`` (default ``~/.cache/shardlm``)."""

from __future__ import annotations

import os
from pathlib import Path

SHARDLM_HOME = "SHARDLM_HOME"
DEFAULT_HOME = "~/.cache/shardlm"


def home() -> Path:
    """Return the shardlm cache folder: ``$SHARDLM_HOME``, default ``~/.cache/shardlm``."""
    return Path(os.environ.get(SHARDLM_HOME) or DEFAULT_HOME).expanduser()


def default_offload_dir() -> Path:
    """$SHARDLM_HOME/offload: where streamed layers go when --offload-dir is not given."""
    return home() / "offload"
