"""Model families: how to read each one's config, build it, split it, and name its tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from shardlm.models import llama
from shardlm.models.args import ModelArgs, ModelConfigError
from shardlm.parallel.tensor import Colwise, ColwiseHeads, Rowwise, RowwiseHeads, Style, VocabEmbedding, VocabHead


@dataclass(frozen=True)
class Family:
    """One registry entry: everything shardlm needs to know about a model family."""

    name: str
    architectures: tuple[str, ...]
    """Hugging Face `architectures` values this family runs."""
    args_from_hf: Callable[[dict[str, Any]], ModelArgs]
    model_class: Callable[[ModelArgs], nn.Module]
    tp_plan: dict[str, Style]
    """Module-name pattern -> tensor-parallel style."""
    checkpoint_name: Callable[[str], str]
    """Model parameter name -> tensor name in the family's checkpoints."""
    presets: dict[str, dict[str, Any]]
    """Named HF-style configs (random-weight shapes for tests and benchmarks)."""


LLAMA_TP_PLAN: dict[str, Style] = {
    "model.embed_tokens": VocabEmbedding(),
    "model.layers.*.self_attn.q_proj": ColwiseHeads("q"),
    "model.layers.*.self_attn.k_proj": ColwiseHeads("kv"),
    "model.layers.*.self_attn.v_proj": ColwiseHeads("kv"),
    "model.layers.*.self_attn.o_proj": RowwiseHeads(),
    "model.layers.*.mlp.gate_proj": Colwise(),
    "model.layers.*.mlp.up_proj": Colwise(),
    "model.layers.*.mlp.down_proj": Rowwise(),
    "lm_head": VocabHead(),
}

_BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
         "bos_token_id": 1, "eos_token_id": 2}

LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # Tiny and awkward on purpose: 12 heads / 4 KV heads, vocab 1001 (divisible by nothing useful).
    "debug": {**_BASE, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 1001,
              "tie_word_embeddings": False},
    "smollm2-135m": {**_BASE, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "llama-3.2-1b": {**_BASE, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-2-7b": {**_BASE, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096},
}

FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        args_from_hf=llama.args_from_hf,
        model_class=llama.LlamaForCausalLM,
        tp_plan=LLAMA_TP_PLAN,
        checkpoint_name=lambda name: name,  # module names already follow HF checkpoints
        presets=LLAMA_PRESETS,
    ),
}


def supported_architectures() -> list[str]:
    """Every Hugging Face architecture name some family runs."""
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def family_for_config(cfg: dict[str, Any]) -> Family:
    """The family that runs this HF config, or a ModelConfigError listing the supported ones."""
    archs = cfg.get("architectures") or []
    for fam in FAMILIES.values():
        if any(a in fam.architectures for a in archs):
            return fam
    raise ModelConfigError(
        f"architecture {', '.join(archs) or '(none given)'} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )


def args_for_config(cfg: dict[str, Any]) -> tuple[Family, ModelArgs]:
    """Family and ModelArgs for an HF config dict."""
    fam = family_for_config(cfg)
    return fam, fam.args_from_hf(cfg)
