"""The linear-layer kernels agree with F.linear, for decode-sized and prefill-sized inputs; settings."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlm import kernels
from shardlm.kernels.linear import LinearOps, OneDNNWeight
from shardlm.settings import Settings, SettingsError


@pytest.fixture(scope="module")
def ext():
    ops = kernels.extension(Settings().kernel_dir)
    assert ops is not None, "the decode kernel should build on this machine"
    return ops


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_t_matches_linear(rows, dtype, ext):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(301, 577, generator=g).to(dtype)  # odd sizes: remainder loops
    x = torch.randn(2, rows, 577, generator=g).to(dtype)
    got, want = kernels.matmul_t(x, w, ext), F.linear(x, w)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("mode", ["gemv", "onednn", "torch"])
def test_install_linears_keeps_results_and_ties(mode, ext):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model[3].weight = model[0].weight  # a tied LM head
    x = torch.randint(0, 50, (1, 12))
    want = model(x)
    used, ops = kernels.choose_mode(mode, Settings().kernel_dir)
    assert used == mode
    kernels.install_linears(model.eval().requires_grad_(False), used, ops)
    assert model[3].weight is model[0].weight, "the tied weight must stay shared, not be packed into a copy"
    if mode != "torch":
        assert isinstance(model[1], LinearOps)
    if mode == "onednn":
        assert model[1].weight is None and isinstance(model[1].kernel_weight, OneDNNWeight)
    if mode == "gemv":
        assert model[1].gemv is ops
    assert torch.allclose(model(x), want, atol=1e-5)  # prefill-sized: F.linear or oneDNN
    assert torch.allclose(model(x[:, :1]), want[:, :1], atol=1e-5)  # decode-sized: the chosen kernel


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="not one of auto, gemv, onednn, torch"):
        kernels.choose_mode("fast", Settings().kernel_dir)


def test_settings_read_the_environment_once_and_refuse_bad_values(tmp_path):
    s = Settings.from_env({"SHARDLM_HOME": str(tmp_path), "SHARDLM_KERNELS": "torch", "SHARDLM_FUSED": "0",
                           "SHARDLM_CUDA_GRAPHS": "0", "SHARDLM_OFFLOAD_UNCACHED": "1"})
    assert (s.home, s.kernels, s.fused, s.cuda_graphs, s.offload_uncached) == (tmp_path, "torch", False, False, True)
    assert s.offload_dir == tmp_path / "offload" and s.kernel_dir == tmp_path / "kernels"
    assert Settings.from_env({}).kernels == "auto" and Settings.from_env({}).fused
    with pytest.raises(SettingsError, match="SHARDLM_KERNELS='fast' is not one of auto, gemv, onednn, torch"):
        Settings.from_env({"SHARDLM_KERNELS": "fast"})
    with pytest.raises(SettingsError, match="SHARDLM_FUSED='yes' is not 0 or 1"):
        Settings.from_env({"SHARDLM_FUSED": "yes"})


def test_only_the_settings_module_reads_the_environment():
    from pathlib import Path

    src = Path(kernels.__file__).resolve().parents[1]
    readers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "os.environ" in p.read_text()
                     and p.name != "settings.py")
    assert readers == [], f"read the environment in shardlm/settings.py only, not in {readers}"


@pytest.mark.parametrize("n,k", [(301, 577), (4, 8), (9, 7), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_do_not_depend_on_the_batch_around_them(n, k, dtype, ext):
    """Each output row has its own accumulator and order: a row alone equals the same row in any batch (a
    served request's tokens must not depend on the requests beside it), for every tile shape and tail."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([ext.gemv(x[j:j + 1], w) for j in range(16)])  # (16, n)
    for b in (2, 3, 5, 8, 16):
        assert torch.equal(ext.gemv(x[:b], w), alone[:b]), b
    torch.testing.assert_close(alone, x @ w.float().T, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("n,k", [(301, 577), (96, 1000), (5, 40)])
def test_int8_gemv_equals_the_dequantized_weight(n, k, ext):
    from shardlm.quant import quantize_int8

    g = torch.Generator().manual_seed(2)
    qw = quantize_int8(torch.randn(n, k, generator=g))  # codes padded to a multiple of 32 columns
    dequantized = qw.q[:, :k].float() * qw.scale.float()[:, None]  # (n, k)
    x = torch.randn(8, k, generator=g)
    got = ext.gemv_int8(x, qw.q, qw.scale)
    torch.testing.assert_close(got, x @ dequantized.T, atol=1e-4, rtol=1e-4)
    assert torch.equal(ext.gemv_int8(x[:1], qw.q, qw.scale), got[:1])
    qw.gemv = ext  # the module path: few rows through the kernel, more through torch's int8 matmul
    torch.testing.assert_close(qw.matmul_t(x[:2]), got[:2])
    many = torch.randn(40, k, generator=g)
    want = many @ dequantized.T
    assert (qw.matmul_t(many) - want).abs().max() <= 1e-2 * want.abs().max()  # torch's kernel: bf16 activations
