"""The fused CPU decode step (shardlm.fused, csrc/decode.h) against the module-by-module path."""

import pytest
import torch

from conftest import RANDOM_MODELS
from shardlm import fused, kernels
from shardlm.models.args import read_config
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.runtime.load import build_rank_model, shard_coord
from shardlm.runtime.step import Batch, Rows


def _load(folder, kernel_mode="gemv", dtype=torch.float32):
    family, args = args_for_config(read_config(folder))
    return build_rank_model(folder, family, args, shard_coord(args, 0, 1), ParallelContext(), dtype,
                            kernels=kernel_mode), args


def _decode_logits(model, args, prompts, steps, use_fused, tokens=None, dtype=torch.float32):
    """Greedy decode of `steps` tokens; returns per-step logits (steps, b, vocab) and the tokens fed.

    With `tokens` given, those are fed instead of the argmax, so two runs see the same inputs.
    """
    fused.ENABLED = use_fused
    batch = Batch.from_lists(prompts)
    rows = Rows(batch, list(range(args.n_layers)), args.n_kv_heads, steps + 1, args, dtype)
    logits = rows.forward(model, batch.tokens, rows.prefill_mask())[:, -1]  # (b, vocab)
    out, fed = [], []
    for i in range(steps):
        token = logits.argmax(-1) if tokens is None else tokens[i]  # (b,)
        fed.append(token)
        logits = rows.forward(model, token[:, None], rows.next_token())[:, -1]
        out.append(logits)
    return torch.stack(out).float(), fed


def _prompts(vocab, lengths=(19, 7, 12)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def _restore():
    yield
    fused.ENABLED = True


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
@torch.no_grad()
def test_fused_decode_matches_modules(name, random_dirs):
    model, args = _load(random_dirs[name])
    assert kernels._ACTIVE is not None, "the compiled kernels should build on this machine"
    prompts = _prompts(args.vocab_size)  # left-padded rows: masks differ per row; mistral_window slides
    ref, fed = _decode_logits(model, args, prompts, 12, use_fused=False)
    got, _ = _decode_logits(model, args, prompts, 12, use_fused=True, tokens=fed)
    assert all(layer._fused_ok[torch.float32] for layer in model.model.layers.values()), "fused path not taken"
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gqa12x4", "biased_mha"])
@torch.no_grad()
def test_fused_decode_bfloat16(name, random_dirs):
    """bfloat16 weights and cache, float32 arithmetic inside: at least as close to the float32 model
    as the module path, which rounds to bfloat16 after every op."""
    f32, args = _load(random_dirs[name])
    prompts = _prompts(args.vocab_size)
    ref, fed = _decode_logits(f32, args, prompts, 12, use_fused=False)
    bf16, _ = _load(random_dirs[name], dtype=torch.bfloat16)
    modules, _ = _decode_logits(bf16, args, prompts, 12, use_fused=False, tokens=fed, dtype=torch.bfloat16)
    got, _ = _decode_logits(bf16, args, prompts, 12, use_fused=True, tokens=fed, dtype=torch.bfloat16)
    assert all(layer._fused_ok[torch.bfloat16] for layer in bf16.model.layers.values()), "fused path not taken"
    scale = ref.abs().max()
    err_fused, err_modules = (got - ref).abs().max() / scale, (modules - ref).abs().max() / scale
    assert err_fused <= 0.05, f"fused bfloat16 is {err_fused:.3f} x max|logit| from float32"
    assert err_fused <= 1.5 * err_modules, (err_fused, err_modules)


@torch.no_grad()
def test_fused_decode_bfloat16_bundled(bundled_dir, prompt64):
    """On the bundled model, teacher-forced with the float32 model's greedy tokens: the fused
    bfloat16 step picks the float32 top-1 token as often as the module path does, with no larger
    logit error. (Free-running greedy runs of either diverge from float32 after a few dozen tokens,
    at whichever near-tie comes first; bench/decode.py prints where.)"""
    f32, args = _load(bundled_dir)
    ref, fed = _decode_logits(f32, args, [prompt64[:40]], 64, use_fused=True)
    bf16, _ = _load(bundled_dir, dtype=torch.bfloat16)
    stats = {}
    for use in (False, True):
        got, _ = _decode_logits(bf16, args, [prompt64[:40]], 64, use_fused=use, tokens=fed, dtype=torch.bfloat16)
        err = ((got - ref).abs().amax(-1) / ref.abs().amax(-1)).median().item()  # per step, relative
        stats[use] = (err, (got.argmax(-1) == ref.argmax(-1)).float().mean().item())
    (err_m, top_m), (err_f, top_f) = stats[False], stats[True]
    assert top_f >= top_m - 1 / 64, stats
    assert err_f <= 1.1 * err_m, stats


@torch.no_grad()
def test_fused_decode_irregular_kv_map(random_dirs):
    """Query heads reading KV heads in an irregular pattern (as uneven TP splits produce)."""
    model, args = _load(random_dirs["gqa12x4"])
    kv_map = [0, 0, 1, 1, 1, 2, 3, 3, 0, 2, 2, 3]
    for layer in model.model.layers.values():
        layer.self_attn.set_kv_map(kv_map)
        assert not layer.self_attn.regular_gqa
    prompts = _prompts(args.vocab_size, (9, 15))
    ref, fed = _decode_logits(model, args, prompts, 8, use_fused=False)
    got, _ = _decode_logits(model, args, prompts, 8, use_fused=True, tokens=fed)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@torch.no_grad()
def test_fused_path_skipped_where_it_does_not_apply(random_dirs):
    """A dtype other than the weights', quantized and oneDNN-packed layers, and batches over
    GEMV_MAX_ROWS take the module path."""
    folder = random_dirs["gqa12x4"]
    model, args = _load(folder, "onednn")
    layer = model.model.layers["0"]
    rows = Rows(Batch.from_lists([[5, 6, 7]]), list(range(args.n_layers)), args.n_kv_heads, 4, args, torch.float32)
    rows.forward(model, torch.tensor([[5, 6, 7]]), rows.prefill_mask())
    mask = rows.next_token()
    x = torch.randn(1, 1, args.dim)
    assert not fused.ready(layer, x, mask, rows.cache)  # packed q/k/v: kernels not active, and not plain
    model, args = _load(folder)
    layer = model.model.layers["0"]
    assert fused.ready(layer, x, mask, rows.cache)
    assert not fused.ready(layer, x.bfloat16(), mask, rows.cache)  # float32 weights, bfloat16 input
    assert not fused.ready(layer, x.half(), mask, rows.cache)
    assert not fused.ready(layer, torch.randn(kernels.GEMV_MAX_ROWS + 1, 1, args.dim), mask, rows.cache)
    assert not fused.ready(layer, x, mask, None)
    family, _ = args_for_config(read_config(folder))
    quantized = build_rank_model(folder, family, args, shard_coord(args, 0, 1), ParallelContext(), quantization="int8")
    assert not fused.ready(quantized.model.layers["0"], x, mask, rows.cache)
