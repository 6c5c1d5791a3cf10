"""Quantized weights do not depend on the TP degree: each rank holds the slice of the tp 1 integers."""

from __future__ import annotations

import pytest
import torch

from refs import build
from shardlm.models.args import read_config
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.launch import run_on_ranks
from shardlm.parallel.styles import ShardCoord, param_slices
from shardlm.quant import Int4Weight, Int8Weight
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch, attention_mask, generate, positions_for
from shardlm.settings import Settings


def _dequantized(model) -> dict[str, torch.Tensor]:
    """Every quantized module's weight (out, in) read back through its kernel (identity input)."""
    out = {}
    for name, m in model.named_modules():
        q = getattr(m, "kernel_weight", None)
        if isinstance(q, (Int8Weight, Int4Weight)):
            out[name] = q.matmul_t(torch.eye(q.in_features)).t().float()  # (out, in)
    return out


def _build(rank, world, folder, kind):
    model = build(folder, rank, ParallelContext(rank, world), settings=Settings(kernels="torch"), tp=world,
                  quantization=kind or "none")
    return _dequantized(model.module)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # debug: 12 heads of 8 dims (o_proj splits inside int4 groups), MLP width 200 (not a multiple of 32)
    return write_random_checkpoint(PRESETS["debug"], tmp_path_factory.mktemp("qtp") / "m", seed=9)


_ONE_RANK: dict = {}
"""(model folder, kind) -> its one-rank dequantized weights, built once (the six cases below share two)."""


def _one_rank(model, kind) -> dict[str, torch.Tensor]:
    """The one-rank reference for `kind`, spawned the first time a case asks for it."""
    key = (str(model), kind)
    if key not in _ONE_RANK:
        _ONE_RANK[key] = run_on_ranks(_build, 1, str(model), kind, timeout_s=120)[0]
    return _ONE_RANK[key]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tp", [2, 3, 5])
def test_each_rank_holds_the_slice_of_the_tp1_quantized_weight(model, kind, tp):
    family, args = args_for_config(read_config(model))
    whole = _one_rank(model, kind)
    ranks = run_on_ranks(_build, tp, str(model), kind, timeout_s=180)
    assert whole and all(r.keys() == whole.keys() for r in ranks)
    for rank, got in enumerate(ranks):
        coord = ShardCoord.for_model(args, rank, tp)
        for name, w in got.items():
            sl = param_slices(f"{name}.weight", tuple(whole[name].shape), family.tp_plan, coord)
            assert torch.equal(w, whole[name][sl]), f"tp {tp} rank {rank} {name}"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_converted_checkpoint_loads_the_weights_quantizing_at_load_gives(model, kind, tmp_path):
    from shardlm.checkpoint.shard import write_whole

    converted = tmp_path / kind
    write_whole(model, converted, 2**17, quantization=kind, progress=False)  # 128 KiB files: several
    assert len(list(converted.glob("*.safetensors"))) > 1
    for tp in (1, 3):
        at_load = [_one_rank(model, kind)] if tp == 1 else run_on_ranks(_build, tp, str(model), kind, timeout_s=180)
        stored = run_on_ranks(_build, tp, str(converted), None, timeout_s=180)
        for rank, (a, b) in enumerate(zip(at_load, stored)):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), f"tp {tp} rank {rank} {name}"


def _build_tied(rank, world, folder, pp):
    model = build(folder, rank, ParallelContext(rank, world), settings=Settings(kernels="torch"), tp=world // pp,
                  pp=pp, quantize_embedding=True)
    return _dequantized(model.module)


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)])
def test_an_int8_embedding_and_its_tied_head_hold_the_tp1_codes_at_any_layout(tmp_path, tp, pp):
    """tp: each rank holds the vocabulary rows of the one-rank table; pp: the last stage, which has no embedding,
    quantizes its copy of the tied head to the codes the first stage's embedding holds."""
    folder = write_random_checkpoint({**PRESETS["debug"], "tie_word_embeddings": True}, tmp_path / "m", seed=2)
    family, args = args_for_config(read_config(folder))
    whole = run_on_ranks(_build_tied, 1, str(folder), 1, timeout_s=120)[0]
    assert {"model.embed_tokens", "lm_head"} <= whole.keys()
    assert torch.equal(whole["model.embed_tokens"], whole["lm_head"])
    ranks = run_on_ranks(_build_tied, tp * pp, str(folder), pp, timeout_s=180)
    if pp > 1:
        assert [sorted(r) for r in ranks] == [["model.embed_tokens"], ["lm_head"]]
        assert torch.equal(ranks[0]["model.embed_tokens"], whole["model.embed_tokens"])
        assert torch.equal(ranks[1]["lm_head"], whole["lm_head"])
        return
    for rank, got in enumerate(ranks):
        coord = ShardCoord.for_model(args, rank, tp)
        for name, w in got.items():
            sl = param_slices(f"{name}.weight", tuple(whole[name].shape), family.tp_plan, coord)
            assert torch.equal(w, whole[name][sl]), f"tp {tp} rank {rank} {name}"


# head_dim 32 (o_proj splits on block boundaries at any tp) and an MLP width of 200 = 6 blocks of 32 + 8
MISALIGNED = {**PRESETS["debug"], "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@torch.no_grad()
def _logits_and_tokens(rank, world, folder, kind, prompts, n_new):
    model = build(folder, rank, ParallelContext(rank, world), tp=world, quantization=kind)
    batch = Batch.from_lists(prompts)
    s = batch.tokens.shape[1]
    logits = model(batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, None))
    return logits, generate(model, batch, n_new, SamplingParams(), ()), model.kernels.describe()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_outputs_are_bitwise_layout_free_when_the_mlp_width_is_not_a_multiple_of_32_per_rank(tmp_path, kind):
    """The MLP width splits in whole blocks of 32 (tp 3: columns [0, 64), [64, 128), [128, 200); an even split would
    start ranks at 67 and 134, inside the blocks the kernels quantize inputs in), so every rank's down-projection
    partial sums add up to the one-rank sums bit for bit: logits and tokens equal at tp 1, 2 and 3."""
    folder = write_random_checkpoint(MISALIGNED, tmp_path / "m", seed=6)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (19, 7)]
    one_logits, one_tokens, kernels = run_on_ranks(_logits_and_tokens, 1, str(folder), kind, prompts, 6,
                                                   timeout_s=120)[0]
    if "gemv" not in kernels:
        pytest.skip(f"the compiled kernels are not available here ({kernels}); exactness is theirs")
    for tp in (2, 3):
        for rank, (logits, tokens, _) in enumerate(run_on_ranks(_logits_and_tokens, tp, str(folder), kind, prompts, 6,
                                                                 timeout_s=180)):
            assert torch.equal(logits, one_logits), f"tp {tp} rank {rank}: max diff {(logits - one_logits).abs().max()}"
            assert tokens == one_tokens, f"tp {tp} rank {rank}"
