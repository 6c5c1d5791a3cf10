"""Where shardlm keeps its files: the cache folder ``$SHARDLM_HOME`` (default ``~/.cache/shardlm``).

The variable is read in `shardlm.settings`, the one module that reads the environment."""

from __future__ import annotations

from pathlib import Path

from shardlm.settings import home


def default_offload_dir() -> Path:
    """$SHARDLM_HOME/offload: where streamed layers go when --offload-dir is not given."""
    return home() / "offload"


__all__ = ["home", "default_offload_dir"]
