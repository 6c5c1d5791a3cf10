"""Joined q/k/v and gate/up products (runtime/projections.py), checked on the CPU with plain linears."""

import torch

from refs import build
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.quant import held_bytes
from shardlm.runtime.projections import join_projections
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch, generate
from shardlm.settings import Settings


def _logits(rank, tokens):
    b, s = tokens.shape
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()  # (b, 1, s, s) causal
    with torch.no_grad():
        return rank.module(tokens, torch.arange(s).expand(b, s), mask)


def test_joined_projections_give_the_same_model_and_hold_no_byte_twice(tmp_path):
    config = {**PRESETS["debug"], "attention_bias": True, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    folder = write_random_checkpoint(config, tmp_path / "m", seed=6)
    rank = build(folder, settings=Settings(kernels="torch"))
    tokens = torch.randint(3, 1001, (2, 11), generator=torch.Generator().manual_seed(0))
    before, held = _logits(rank, tokens), held_bytes(rank.module)
    want = generate(rank, Batch.from_lists([[5, 9, 14, 3], [7, 7]]), 10, SamplingParams(), ())
    assert join_projections(rank.module) == rank.args.n_layers
    layer = rank.module.model.layers["0"]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.qkv_bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.out_features:].data_ptr()
    assert held_bytes(rank.module) == held  # the modules' weights are views of the joined tensors
    torch.testing.assert_close(_logits(rank, tokens), before, rtol=1e-5, atol=1e-5)
    assert generate(rank, Batch.from_lists([[5, 9, 14, 3], [7, 7]]), 10, SamplingParams(), ()) == want


def test_quantized_or_kernel_linears_are_left_alone(tmp_path):
    folder = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=7)
    rank = build(folder, quantization="int8", settings=Settings(kernels="torch"))
    assert join_projections(rank.module) == 0
    assert rank.module.model.layers["0"].self_attn.qkv_weight is None
