"""Named model configs kept inside the package (no network): public models and test shapes.

Each value is a Hugging Face style config.json dict. Public entries copy the architecture fields of
the published config (sizes, heads, vocabulary, rope); they are what `inspect` and `plan` accept by
name. `debug` is a tiny awkward shape for tests; `smollm2-135m` also names the bundled checkpoint.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from shardlm.models.args import ModelConfigError, read_config

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}

_LLAMA31 = {**_LLAMA, "vocab_size": 128256, "num_key_value_heads": 8, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny and awkward on purpose: 12 heads / 4 KV heads, vocab 1001 (divisible by nothing useful).
    "debug": {**_LLAMA, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 1001},
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "llama-3.2-1b": {**_LLAMA31, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "tie_word_embeddings": True,
                     "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}},
    "llama-2-7b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096},
    "llama-3.1-8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32},
    "llama-3.1-70b": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64},
    "llama-3.1-405b": {**_LLAMA31, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                       "num_attention_heads": 128},
    # Mistral-7B v0.3: 32768-token vocabulary, rope base 1e6, no sliding window.
    "mistral-7b": {**_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
                   "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None},
    "qwen2.5-72b": {**_LLAMA, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                    "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                    "sliding_window": 131072, "use_sliding_window": False,
                    "bos_token_id": 151643, "eos_token_id": 151645},
    "mixtral-8x7b": {**_LLAMA, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1000000.0,
                     "max_position_embeddings": 32768, "sliding_window": None},
}

PUBLIC = ("smollm2-135m", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "mistral-7b", "qwen2.5-72b",
          "mixtral-8x7b", "llama-3.2-1b", "llama-2-7b")
"""Presets that describe published models (the rest are test shapes)."""


def preset_config(name: str) -> dict[str, Any]:
    """The config dict of preset `name` (case-insensitive); unknown names get close suggestions."""
    key = name.strip().lower()
    if key in PRESETS:
        return dict(PRESETS[key])
    close = difflib.get_close_matches(key, PRESETS, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ModelConfigError(f"unknown model preset {name!r}; {hint}known presets: {', '.join(sorted(PRESETS))}; "
                           "or pass a local folder holding config.json")


def resolve_config(model: str) -> tuple[dict[str, Any], str]:
    """Config dict and a display name for MODEL: a local folder with config.json, or a preset name."""
    path = Path(model).expanduser()
    if path.is_dir():
        return read_config(path), str(path)
    if "/" in model or model.startswith("."):
        raise ModelConfigError(f"model folder {model} does not exist; give a local folder holding config.json "
                               f"or a preset name ({', '.join(PUBLIC)})")
    return preset_config(model), model.strip().lower()
