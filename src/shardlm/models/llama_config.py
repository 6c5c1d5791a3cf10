"""Llama-family Hugging Face configs read into ModelArgs (torch-free: the driver and the planner use it)."""

from __future__ import annotations

from typing import Any

from shardlm.models.args import ModelArgs, ModelConfigError


def args_from_hf(cfg: dict[str, Any]) -> ModelArgs:
    """Build ModelArgs from a Hugging Face Llama/Mistral/Qwen2 config dict."""
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = cfg.get("model_type", "llama")
        qkv_bias = bool(cfg.get("attention_bias", False)) or model_type == "qwen2"
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
        return ModelArgs(
            family="mixtral" if cfg.get("num_local_experts") else "llama",
            architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(cfg),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_bias=bool(cfg.get("attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            n_experts=int(cfg.get("num_local_experts") or 0),
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if cfg.get("num_local_experts") else 0,
        )
    except KeyError as e:
        raise ModelConfigError(f"config.json lacks the field {e.args[0]!r} that a Llama-family model needs") from e


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Normalize rope scaling (HF `rope_scaling` or newer `rope_parameters`) to a dict or None."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelConfigError(f"rope scaling type {kind!r} is not supported; supported: llama3, linear, none")
    return {**rs, "rope_type": kind}
