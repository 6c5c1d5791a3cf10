"""shardlm: run language models sharded across devices, processes and machines."""

__version__ = "0.1.0"
