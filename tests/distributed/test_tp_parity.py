"""Tensor parallelism on spawned gloo ranks: logits and greedy tokens equal the unsharded model's."""

import pytest
import torch

from conftest import hf_model
from refs import assert_logits_close, hf_logits_and_tokens, shardlm_rank
from shardlm.parallel.launch import run_on_ranks
from shardlm.runtime.step import Batch


def _check(folder, prompts, n_new, tp, shm=True):
    ref_logits, ref_tokens = hf_logits_and_tokens(hf_model(folder), prompts, n_new)
    results = run_on_ranks(shardlm_rank, tp, str(folder), prompts, n_new, shm, timeout_s=240)
    logits = results[0][0]
    assert_logits_close(logits, ref_logits, Batch.from_lists(prompts).valid)
    for rank, (_, tokens, _) in enumerate(results):
        assert tokens == ref_tokens, f"rank {rank} tokens differ from transformers"
    return results


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_bundled_model_any_tp(bundled_dir, prompt64, tp):
    """9 heads / 3 KV heads: tp 2 and 4 split heads unevenly and replicate KV heads."""
    results = _check(bundled_dir, [prompt64], 32, tp)
    if tp > 1:
        comms = results[0][2]
        # one all-reduce after attention and one after the MLP per layer, plus one for the embedding
        forwards = 1 + 1 + 31  # the full-logits forward, the prefill, 31 decode steps
        assert comms["all_reduce"]["calls"] == (30 * 2 + 1) * forwards
        assert comms["all_gather"]["calls"] == forwards


def _random_prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name,tp", [
    ("gqa12x4", 5),         # 12 heads at tp 5: q 3/3/2/2/2, KV groups straddle ranks; vocab 1001
    ("gqa12x4", 4),         # even split, KV heads 4 = tp
    ("qwen2", 4),           # q/k/v bias, tied embeddings, tp > kv heads (replicated)
    ("llama3rope", 3),      # llama3 rope scaling, vocab 1000 at tp 3
    ("biased_mha", 3),      # attention + MLP biases, 5 heads at tp 3
    ("mistral_window", 2),  # sliding window shorter than the prompt
])
def test_random_models_awkward_shapes(random_dirs, name, tp):
    folder = random_dirs[name]
    vocab = hf_model(folder).config.vocab_size
    _check(folder, _random_prompts(vocab, [37, 12, 25]), 12, tp)


def test_gloo_transport_matches_too(random_dirs):
    """The plain gloo collectives (no shared memory) give the same results."""
    folder = random_dirs["gqa12x4"]
    _check(folder, _random_prompts(1001, [20, 9]), 8, 3, shm=False)


def test_batch_of_different_lengths_on_bundled_model(bundled_dir, prompt64):
    prompts = [prompt64[:64], prompt64[5:20], prompt64[30:37]]
    _check(bundled_dir, prompts, 16, 2)
