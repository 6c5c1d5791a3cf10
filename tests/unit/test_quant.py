"""Weight-only int8/int4: error bounds, padding paths, the model built quantized, bad kinds."""

from __future__ import annotations

import pytest
import torch

from shardlm.models.args import read_config
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.quant_spec import QuantizationError, check_kind, linear_bytes
from shardlm.quant import (INT4_GROUP, Int4Weight, quantize_int4,
                           quantize_int8)
from refs import build
from shardlm.settings import Settings
from shardlm.runtime.step import attention_mask, positions_for


def dequantized(qw, in_features: int) -> torch.Tensor:
    """The weight (out, in) a quantized weight stands for, read back through its own kernel."""
    eye = torch.eye(in_features)  # exact in bfloat16
    return qw.matmul_t(eye).t().float()  # (out, in)


def _weight(out: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, k, generator=g) * 0.05


@pytest.mark.parametrize("out,k", [(64, 96), (200, 96), (96, 200), (24, 40)])
def test_int8_error_is_within_half_a_step_per_row(out, k):
    w = _weight(out, k)
    qw = quantize_int8(w)
    deq = dequantized(qw, k)
    step = w.abs().amax(1, keepdim=True) / 127
    # half a step of rounding, plus bfloat16 rounding of the scale and of the read-back
    assert ((deq - w).abs() <= step * 0.5 + w.abs() * 2**-7 + 1e-6).all()
    assert qw.q.dtype == torch.int8 and (k + qw.pad) % 32 == 0
    assert qw.nbytes() == out * (k + qw.pad) + out * 4 == linear_bytes(out, k, "int8")  # float32 scales on the CPU
    assert torch.equal(qw.scale, qw.scale.bfloat16().float())  # holding bfloat16 values


@pytest.mark.parametrize("out,k,start,total", [(64, 96, 0, 96), (200, 96, 0, 96), (96, 200, 0, 200),
                                               (40, 50, 17, 200), (16, 32, 32, 64)])
def test_int4_error_is_within_half_a_step_per_group_and_padding_is_invisible(out, k, start, total):
    w = _weight(out, k, seed=1)
    qw = quantize_int4(w, start, total)
    assert isinstance(qw, Int4Weight) and qw.pad_left == start % INT4_GROUP
    deq = dequantized(qw, k)
    # groups counted from column `start` of the full tensor: the slice's own columns per group
    cols = torch.arange(start, start + k) // INT4_GROUP
    for g in cols.unique():
        part = w[:, cols == g]
        step = (part.amax(1, keepdim=True) - part.amin(1, keepdim=True)) / 15
        err = (deq[:, cols == g] - part).abs()
        assert (err <= step * 0.5 + part.abs() * 2**-7 + step * 2**-6 + 1e-6).all(), int(g)
    x = torch.randn(3, k).bfloat16().float()
    assert torch.allclose(qw.matmul_t(x), x @ deq.t(), rtol=2e-2, atol=2e-2)


def test_int4_of_an_aligned_slice_equals_the_slice_of_the_whole():
    w = _weight(48, 128, seed=2)
    whole = dequantized(quantize_int4(w), 128)
    part = dequantized(quantize_int4(w[:, 32:96], 32, 128), 64)
    assert torch.equal(part, whole[:, 32:96])


def test_bad_kinds_name_the_fix():
    with pytest.raises(QuantizationError, match="use none, int8 or int4"):
        check_kind("int3")
    with pytest.raises(QuantizationError, match="runs on cpu and cuda ranks, not on mps"):
        check_kind("int4", "mps")
    check_kind(None), check_kind("none"), check_kind("int8", "cuda"), check_kind("int4", "cuda")


@pytest.fixture(scope="module")
def debug_model(tmp_path_factory):
    return write_random_checkpoint(PRESETS["debug"], tmp_path_factory.mktemp("q") / "m", seed=5)


@pytest.mark.parametrize("kind,ratio,min_cos", [("int8", 0.35, 0.995), ("int4", 0.3, 0.95)])
def test_quantized_model_is_smaller_and_close_to_float(debug_model, kind, ratio, min_cos):
    load = lambda q: build(debug_model, settings=Settings(kernels="torch"), quantization=q)  # noqa: E731
    ref, quant = load("none"), load(kind)
    args = ref.args
    ids = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    valid = torch.ones_like(ids, dtype=torch.bool)
    mask = attention_mask(valid, 0, 12, None)
    a, b = ref(ids, positions_for(valid), mask), quant(ids, positions_for(valid), mask)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > min_cos, float(cos)  # random N(0, 0.05) weights: int4 rounding noise is ~9% per weight
    linear = sum(p.numel() for n, p in ref.module.named_parameters()
                 if n.endswith("_proj.weight") or n == "lm_head.weight")
    saved = ref.resident_bytes() - quant.resident_bytes()
    assert saved > linear * 4 * (1 - ratio), (saved, linear)
    assert not any(n.endswith("_proj.weight") for n, _ in quant.module.named_parameters())
