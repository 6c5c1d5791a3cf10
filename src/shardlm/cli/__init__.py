"""The `shardlm` command line (see app.py); `main` runs it."""

from shardlm.cli.app import app, main

__all__ = ["app", "main"]
