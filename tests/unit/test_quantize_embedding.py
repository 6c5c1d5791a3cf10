"""`--quantize-embedding`: the embedding and a head tied to it as one int8 table, planned, written and built alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refs import build, plan_for
from shardlm.manifest import ManifestError, parse_manifest, plan_to_yaml
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.plan.memory import shard_weights
from shardlm.quant import Int8Embedding, Int8Weight, quantize_int8
from shardlm.quant_spec import linear_bytes
from shardlm.runtime.step import attention_mask, positions_for
from shardlm.settings import Settings

# the debug shape (vocab 1001, dim 96) with its head tied to the embedding, as the bundled model's is
TIED = {**PRESETS["debug"], "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    return write_random_checkpoint(TIED, tmp_path_factory.mktemp("qe") / "m", seed=3)


def _logits(rank, ids):
    valid = torch.ones_like(ids, dtype=torch.bool)
    return rank(ids, positions_for(valid), attention_mask(valid, 0, ids.shape[1], None))


@pytest.mark.parametrize("kernels", ["gemv", "torch"])
def test_the_tied_head_multiplies_by_the_embeddings_own_codes(tied_model, kernels):
    settings = Settings(kernels=kernels)
    ref = build(tied_model, settings=settings)
    quant = build(tied_model, settings=settings, quantize_embedding=True)
    embed, head = quant.module.model.embed_tokens, quant.module.lm_head
    assert isinstance(embed, Int8Embedding) and isinstance(head.kernel_weight, Int8Weight)
    assert head.kernel_weight is embed.kernel_weight and head.weight is None  # one table, no float copy
    vocab, dim = TIED["vocab_size"], TIED["hidden_size"]
    saved = ref.resident_bytes() - quant.resident_bytes()
    assert saved == vocab * dim * 4 - linear_bytes(vocab, dim, "int8")
    # the planner counts what the rank holds
    predicted = [plan_for(tied_model, quantize_embedding=q)[0].predictions.memory[0].weights for q in (False, True)]
    assert predicted[0] - predicted[1] == saved

    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    codes = quantize_int8(ref.module.model.embed_tokens.weight)  # what the flag rounds the table to
    rows = codes.q[ids][..., :dim].float() * codes.scale[ids].float()[..., None]  # (2, 9, dim)
    assert torch.equal(embed(ids), rows)
    a, b = _logits(ref, ids), _logits(quant, ids)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert 0.999 < cos < 1, float(cos)  # rounded (not equal) and close


def test_an_untied_head_is_left_as_the_quantization_made_it(tmp_path):
    model = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=4)
    rank = build(model, quantize_embedding=True)
    assert isinstance(rank.module.model.embed_tokens, Int8Embedding)
    assert rank.module.lm_head.kernel_weight is None and rank.module.lm_head.weight.dtype == torch.float32
    w_float = shard_weights(rank.args, {}, 1, 0, "float32", "none")
    w_int8 = shard_weights(rank.args, {}, 1, 0, "float32", "none", embedding="int8")
    assert (w_int8.embed, w_int8.head) == (linear_bytes(1001, 96, "int8"), w_float.head)


def test_the_manifest_carries_it_and_refuses_it_with_a_streamed_vocabulary(tied_model):
    plan = plan_for(tied_model, quantize_embedding=True)[0]
    text = plan_to_yaml(plan)
    assert "embedding: int8" in text
    back = parse_manifest(text)
    assert back.embedding == "int8" and back.rank_spec(0).embedding == "int8"
    plain = plan_to_yaml(dataclasses.replace(plan, embedding="float"))
    assert "embedding:" not in plain and parse_manifest(plain).embedding == "float"  # the default, not written
    bad = text.replace("embedding: int8", "embedding: int4")
    with pytest.raises(ManifestError, match="embedding: expected one of float, int8, got 'int4'"):
        parse_manifest(bad, source="m.yaml")
    offload = "  tier: none\n  layers: []\n  dir: null\n  prefetch: true\n"
    assert offload in text
    streamed = text.replace(offload, "  tier: disk\n  layers: [0]\n  dir: null\n  prefetch: true\n  vocab: [true]\n")
    with pytest.raises(ManifestError, match="only a float embedding streams.*set embedding: float"):
        parse_manifest(streamed, source="m.yaml")


def test_a_memory_budget_streams_layers_not_the_int8_vocabulary(tied_model):
    plan = plan_for(tied_model, quantize_embedding=True, memory_budget=1_000_000)[0]
    assert plan.offload.tier == "disk" and sum(plan.offload.layers) > 0 and not any(plan.offload.vocab)
    rank = build(tied_model, quantize_embedding=True, memory_budget=1_000_000)
    assert isinstance(rank.module.model.embed_tokens, Int8Embedding)


def test_cpu_ranks_are_planned_to_all_reduce_quantized_partial_sums_in_float64(tied_model):
    """Row-parallel quantized layers all-reduce float64 partial sums on CPU ranks (shardlm.quant): the planner
    counts those bytes, so their collectives cost more than float32 ones."""
    def collectives(quantization):
        plan = plan_for(tied_model, tp=2, quantization=quantization)[0]
        return plan.predictions.performance.breakdown["collectives"]
    assert collectives("int8") > collectives("none") > 0
