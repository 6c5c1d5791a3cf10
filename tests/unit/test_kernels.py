"""The linear-layer kernels agree with F.linear, for decode-sized and prefill-sized inputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlm import kernels


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_t_matches_linear(rows, dtype):
    assert kernels.gemv_module() is not None, "the decode kernel should build on this machine"
    kernels.prepare_linears(nn.Sequential(), "gemv")  # selects the compiled kernel for this process
    assert kernels._ACTIVE is not None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(301, 577, generator=g).to(dtype)  # odd sizes: remainder loops
    x = torch.randn(2, rows, 577, generator=g).to(dtype)
    got, want = kernels.matmul_t(x, w), F.linear(x, w)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("mode", ["gemv", "onednn", "torch"])
def test_prepare_linears_keeps_results_and_ties(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model[3].weight = model[0].weight  # a tied LM head
    x = torch.randint(0, 50, (1, 12))
    want = model(x)
    used = kernels.prepare_linears(model.eval().requires_grad_(False), mode)
    assert used == mode
    assert model[3].weight is model[0].weight, "the tied weight must stay shared, not be packed into a copy"
    if mode == "onednn":
        assert model[1].weight is None and model[1].packed is not None
    assert torch.allclose(model(x), want, atol=1e-5)  # prefill-sized: F.linear or oneDNN
    assert torch.allclose(model(x[:, :1]), want[:, :1], atol=1e-5)  # decode-sized: the chosen kernel


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="not one of auto, gemv, onednn, torch"):
        kernels.choose_mode("fast")
