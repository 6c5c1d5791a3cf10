"""ModelArgs: the shape of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A model folder or config that shardlm cannot use; the message names the fix."""


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    family: str
    """Registry key of the family, e.g. "llama"."""
    architecture: str
    """The Hugging Face architecture name, e.g. "LlamaForCausalLM"."""
    dim: int
    """Hidden size."""
    n_layers: int
    """Number of decoder layers."""
    n_heads: int
    """Number of query heads."""
    n_kv_heads: int
    """Number of key/value heads (GQA); equals n_heads for multi-head attention."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Hidden width of the gated MLP."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Hugging Face rope_scaling dict (type "llama3" or "linear"), or None."""
    max_seq_len: int = 2048
    """max_position_embeddings: the longest sequence the model is configured for."""
    tie_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2); o_proj bias follows `o_bias`."""
    o_bias: bool = False
    """o_proj carries a bias (Llama with attention_bias=True)."""
    mlp_bias: bool = False
    """gate/up/down projections carry a bias."""
    sliding_window: int | None = None
    """Mistral/Qwen2 sliding-window size; None when unused (full attention)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """End-of-sequence token ids (generation stops on any)."""
    n_experts: int = 0
    """Mixture-of-experts: experts per layer (Mixtral's num_local_experts); 0 for a dense MLP."""
    experts_per_token: int = 0
    """Mixture-of-experts: experts each token is routed to (num_experts_per_tok); 0 when dense."""

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.n_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-safe) for passing to rank processes."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        """Inverse of `to_dict`."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


def read_config(folder: Path) -> dict[str, Any]:
    """Read `config.json` from a model folder, with errors that name the folder and the fix."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelConfigError(
            f"model folder {folder} does not exist; pass --model PATH to a local Hugging Face "
            "folder, or omit --model for the bundled SmolLM2-135M-Instruct"
        )
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelConfigError(
            f"{folder} is not a model folder: it has no config.json; pass --model PATH to a folder "
            "holding config.json, safetensors weights and tokenizer files"
        )
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{cfg} is not valid JSON (line {e.lineno}: {e.msg}); fix or re-download it") from e
