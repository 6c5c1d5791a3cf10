"""The fused CPU decode step (shardlm.kernels.fused, csrc/decode.h) against the module-by-module path."""

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

from conftest import RANDOM_MODELS
from refs import build
from shardlm.kernels import GEMV_MAX_ROWS
from shardlm.kernels.fused import FusedDecode, FusedStack
from shardlm.runtime.step import Batch, Rows
from shardlm.settings import Settings


def _load(folder, kernel_mode="gemv", dtype=torch.float32, **flags):
    rank = build(folder, settings=Settings(kernels=kernel_mode), dtype=str(dtype).removeprefix("torch."), **flags)
    return rank, rank.args


class _Counted:
    """A layer's installed decode step, counting the calls it ran fused."""

    def __init__(self, step):
        self.step, self.runs = step, 0

    def __call__(self, *args):
        out = self.step(*args)
        self.runs += out is not None
        return out


@contextmanager
def _fused(rank, use: bool):
    """Run with the installed fused steps (counted) or without them (the module path)."""
    layers = list(rank.module.model.layers.values())
    saved = [layer.decode_step for layer in layers]
    for layer, step in zip(layers, saved):
        layer.decode_step = _Counted(step) if use and step is not None else None
    try:
        yield [layer.decode_step for layer in layers]
    finally:
        for layer, step in zip(layers, saved):
            layer.decode_step = step


def _decode_logits(rank, args, prompts, steps, use_fused, tokens=None, dtype=torch.float32):
    """Greedy decode of `steps` tokens; returns per-step logits (steps, b, vocab), the tokens fed, and how
    many block calls ran fused.

    With `tokens` given, those are fed instead of the argmax, so two runs see the same inputs.
    """
    batch = Batch.from_lists(prompts)
    rows = Rows.for_model(rank, batch, steps + 1)
    with _fused(rank, use_fused) as steps_installed:
        logits = rows.forward(rank.module, batch.tokens, rows.prefill_mask())[:, -1]  # (b, vocab)
        out, fed = [], []
        for i in range(steps):
            token = logits.argmax(-1) if tokens is None else tokens[i]  # (b,)
            fed.append(token)
            logits = rows.forward(rank.module, token[:, None], rows.next_token())[:, -1]
            out.append(logits)
        runs = sum(s.runs for s in steps_installed if s is not None)
    return torch.stack(out).float(), fed, runs


def _prompts(vocab, lengths=(19, 7, 12)):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
@torch.no_grad()
def test_fused_decode_matches_modules(name, random_dirs):
    model, args = _load(random_dirs[name])
    assert model.kernels.linear == "gemv", "the compiled kernels should build on this machine"
    assert model.kernels.fused_layers == args.n_layers
    prompts = _prompts(args.vocab_size)  # left-padded rows: masks differ per row; mistral_window slides
    ref, fed, _ = _decode_logits(model, args, prompts, 12, use_fused=False)
    got, _, runs = _decode_logits(model, args, prompts, 12, use_fused=True, tokens=fed)
    assert runs == 12 * args.n_layers, "fused path not taken"
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gqa12x4", "biased_mha"])
@torch.no_grad()
def test_fused_decode_bfloat16(name, random_dirs):
    """bfloat16 weights and cache, float32 arithmetic inside: at least as close to the float32 model
    as the module path, which rounds to bfloat16 after every op."""
    f32, args = _load(random_dirs[name])
    prompts = _prompts(args.vocab_size)
    ref, fed, _ = _decode_logits(f32, args, prompts, 12, use_fused=False)
    bf16, _ = _load(random_dirs[name], dtype=torch.bfloat16)
    modules, _, _ = _decode_logits(bf16, args, prompts, 12, use_fused=False, tokens=fed, dtype=torch.bfloat16)
    got, _, runs = _decode_logits(bf16, args, prompts, 12, use_fused=True, tokens=fed, dtype=torch.bfloat16)
    assert runs == 12 * args.n_layers, "fused path not taken"
    scale = ref.abs().max()
    err_fused, err_modules = (got - ref).abs().max() / scale, (modules - ref).abs().max() / scale
    assert err_fused <= 0.05, f"fused bfloat16 is {err_fused:.3f} x max|logit| from float32"
    assert err_fused <= 1.5 * err_modules, (err_fused, err_modules)


@pytest.mark.parametrize("name", ["gqa12x4", "biased_mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.no_grad()
def test_fused_decode_quantized(name, dtype, kind, random_dirs):
    """int8 and int4 weights: the fused step (integer dot products on block-quantized inputs) runs every block and
    is as close to the float32 model as the module path, whose few-row matmuls run the same kernels one
    projection at a time. The two are not equal to 1e-4: the norms and rotary differ in their last bits, and
    an input that lands near half a step of its block's scale rounds to the other code."""
    f32, args = _load(random_dirs[name])
    prompts = _prompts(args.vocab_size)
    exact, fed, _ = _decode_logits(f32, args, prompts, 12, use_fused=False)
    model, _ = _load(random_dirs[name], dtype=dtype, quantization=kind)
    assert model.kernels.fused_layers == args.n_layers, f"{kind} blocks should take the fused step"
    weights = {n: m.kernel_weight for n, m in model.module.model.layers["0"].named_modules()
               if hasattr(getattr(m, "kernel_weight", None), "exact")}
    assert len(weights) == 7 and {n for n, w in weights.items() if w.exact} == {"self_attn.o_proj", "mlp.down_proj"}
    ref, _, _ = _decode_logits(model, args, prompts, 12, use_fused=False, tokens=fed, dtype=dtype)
    got, _, runs = _decode_logits(model, args, prompts, 12, use_fused=True, tokens=fed, dtype=dtype)
    assert runs == 12 * args.n_layers, "fused path not taken"
    scale = exact.abs().max()
    err_fused, err_modules = (got - exact).abs().max() / scale, (ref - exact).abs().max() / scale
    if dtype == torch.float32:  # bfloat16: the module path rounds after every op, so only the errors compare
        assert (got - ref).abs().max() <= 0.05 * scale
    assert err_fused <= 1.25 * err_modules + 0.01, (err_fused, err_modules)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@torch.no_grad()
def test_fused_decode_bfloat16_bundled(bundled_dir, prompt64):
    """On the bundled model, teacher-forced with the float32 model's greedy tokens: the fused
    bfloat16 step picks the float32 top-1 token as often as the module path does, with no larger
    logit error. (Free-running greedy runs of either diverge from float32 after a few dozen tokens,
    at whichever near-tie comes first; bench/decode.py prints where.)"""
    f32, args = _load(bundled_dir)
    ref, fed, _ = _decode_logits(f32, args, [prompt64[:40]], 64, use_fused=True)
    bf16, _ = _load(bundled_dir, dtype=torch.bfloat16)
    stats = {}
    for use in (False, True):
        got, _, _ = _decode_logits(bf16, args, [prompt64[:40]], 64, use_fused=use, tokens=fed, dtype=torch.bfloat16)
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
    for layer in model.module.model.layers.values():
        layer.self_attn.set_kv_map(kv_map)
        assert not layer.self_attn.regular_gqa
    prompts = _prompts(args.vocab_size, (9, 15))
    ref, fed, _ = _decode_logits(model, args, prompts, 8, use_fused=False)
    got, _, runs = _decode_logits(model, args, prompts, 8, use_fused=True, tokens=fed)
    assert runs == 8 * args.n_layers
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@torch.no_grad()
def test_fused_path_skipped_where_it_does_not_apply(random_dirs):
    """A dtype other than the weights', oneDNN-packed layers, quantized ones without the compiled kernels, and
    batches over GEMV_MAX_ROWS take the module path."""
    folder = random_dirs["gqa12x4"]
    packed, args = _load(folder, "onednn")
    assert packed.kernels.fused_layers == 0  # packed q/k/v: not plain, no fused step installed
    assert all(layer.decode_step is None for layer in packed.module.model.layers.values())
    model, args = _load(folder)
    step = model.module.model.layers["0"].decode_step
    assert isinstance(step, FusedDecode)
    rows = Rows.for_model(model, Batch.from_lists([[5, 6, 7]]), 4)
    rows.forward(model.module, torch.tensor([[5, 6, 7]]), rows.prefill_mask())
    mask = rows.next_token()
    x = torch.randn(1, 1, args.dim)
    assert step.applies(x, mask, rows.cache)
    assert not step.applies(x.bfloat16(), mask, rows.cache)  # float32 weights, bfloat16 input
    assert not step.applies(x.half(), mask, rows.cache)
    assert not step.applies(torch.randn(GEMV_MAX_ROWS + 1, 1, args.dim), mask, rows.cache)
    assert not step.applies(x, mask, None)
    quantized = build(folder, quantization="int4", settings=Settings(kernels="onednn"))
    assert quantized.kernels.fused_layers == 0  # quantized, but no compiled kernels chosen
    assert quantized.module.model.layers["0"].decode_step is None


def _teacher_forced(rank, prompts, tokens, caches: list | None = None):
    """Per-step logits (steps, b, vocab) of `tokens` fed after the prompts, through whatever steps are installed
    (`caches`: gets a weak reference to the run's first key cache)."""
    batch = Batch.from_lists(prompts)
    rows = Rows.for_model(rank, batch, len(tokens) + 1)
    if caches is not None:
        caches.append(weakref.ref(next(iter(rows.cache.k.values()))))
    rows.forward(rank.module, batch.tokens, rows.prefill_mask())
    return torch.stack([rows.forward(rank.module, t[:, None], rows.next_token())[:, -1] for t in tokens]).float()


@pytest.mark.parametrize("name", ["gqa12x4", "biased_mha"])
@pytest.mark.parametrize("dtype,kind", [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "int8"),
                                        (torch.float32, "int4"), (torch.bfloat16, "int4")])
@torch.no_grad()
def test_every_block_in_one_call_equals_the_blocks_one_by_one(name, dtype, kind, random_dirs):
    """The one-rank stack (csrc/stack.h) runs every decode step of the run and gives the per-block fused path's
    logits bit for bit, for float32, bfloat16, int8 and int4 weights, biases and grouped KV heads."""
    model, args = _load(random_dirs[name], dtype=dtype, **({} if kind == "none" else {"quantization": kind}))
    stack = model.module.decode_stack
    assert isinstance(stack, FusedStack), "a one-rank model whose blocks all fuse gets the stack"
    prompts = _prompts(args.vocab_size)
    _, fed, _ = _decode_logits(model, args, prompts, 12, use_fused=False)  # tokens to feed both runs
    counted = model.module.decode_stack = _Counted(stack)
    caches = []
    try:
        whole = _teacher_forced(model, prompts, fed, caches)
        again = _teacher_forced(model, prompts, fed, caches)  # a new cache: the stack takes it at each call
    finally:
        model.module.decode_stack = None
    blocks = _teacher_forced(model, prompts, fed)  # each block's FusedDecode in turn
    model.module.decode_stack = stack
    assert counted.runs == 24, "the stack did not run every decode step"
    assert torch.equal(whole, blocks) and torch.equal(again, blocks)
    gc.collect()
    assert [ref() for ref in caches] == [None, None], "the stack kept a finished run's KV cache alive"


@pytest.mark.parametrize("kind", ["none", "int4"])
@torch.no_grad()
def test_the_stack_gives_the_same_bits_with_any_number_of_threads(kind, random_dirs):
    """The stack's one parallel region (csrc/stack_step.h) splits each product's rows, the heads' rotary and the
    attention tasks by the team's size; a value must not depend on which thread computed it: teams of 1, 2 and 3
    threads give the same logits bit for bit."""
    model, args = _load(random_dirs["gqa12x4"], **({} if kind == "none" else {"quantization": kind}))
    assert isinstance(model.module.decode_stack, FusedStack)
    prompts = _prompts(args.vocab_size)
    _, fed, _ = _decode_logits(model, args, prompts, 8, use_fused=False)
    threads, stack = torch.get_num_threads(), model.module.decode_stack
    counted = model.module.decode_stack = _Counted(stack)
    try:
        got = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got.append(_teacher_forced(model, prompts, fed))
    finally:
        torch.set_num_threads(threads)
        model.module.decode_stack = stack
    assert counted.runs == 3 * len(fed), "the stack did not run every decode step"
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


@torch.no_grad()
def test_a_stack_step_with_a_misshaped_cache_names_the_block_and_writes_nothing(random_dirs):
    """A cache of the wrong shape is refused before any thread starts, naming the block, and no cache is written."""
    model, args = _load(random_dirs["gqa12x4"])
    stack = model.module.decode_stack
    prompts = _prompts(args.vocab_size)
    _teacher_forced(model, prompts, _decode_logits(model, args, prompts, 2, use_fused=False)[1])  # builds the kernel
    layers = len(stack.layers)
    kv_heads, head_dim = args.n_kv_heads, args.head_dim
    caches = [(torch.zeros(2, kv_heads, 16, head_dim), torch.zeros(2, kv_heads, 16, head_dim)) for _ in range(layers)]
    caches[1] = (torch.zeros(2, kv_heads, 16, head_dim + 2), torch.zeros(2, kv_heads, 16, head_dim + 2))
    x = torch.randn(1, args.dim)
    cos, sin = torch.ones(1, head_dim), torch.zeros(1, head_dim)
    rows, positions = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="block 1"):
        stack._kernel.step(x, cos, sin, rows, positions, mask, caches)
    assert all(not k.any() and not v.any() for k, v in caches), "a refused step wrote a cache"
    with pytest.raises(RuntimeError, match=f"{layers} blocks but {layers - 1} caches"):
        stack._kernel.step(x, cos, sin, rows, positions, mask, caches[:-1])
