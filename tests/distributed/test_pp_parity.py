"""Pipeline parallelism (and tp x pp hybrids) on spawned gloo ranks: logits and greedy tokens equal the
unsharded model's, for even and uneven stages, micro-batches and prompts of different lengths."""

import pytest
import torch

from conftest import hf_model
from refs import assert_logits_close, hf_logits_and_tokens, shardlm_stage_rank
from shardlm.parallel.launch import run_on_ranks
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch


@pytest.fixture(scope="module")
def bundled_prompts(prompt64):
    return [prompt64[:41], prompt64[3:12], prompt64[20:45], prompt64[50:53]]


@pytest.fixture(scope="module")
def bundled_ref(bundled_dir, bundled_prompts):
    return hf_logits_and_tokens(hf_model(bundled_dir), bundled_prompts, 12)


def _run(folder, prompts, n_new, tp, counts, m, sampling=SamplingParams()):
    return run_on_ranks(shardlm_stage_rank, tp * len(counts), str(folder), prompts, n_new, tp, list(counts), m,
                        sampling, timeout_s=240)


def _check(results, ref, prompts):
    ref_logits, ref_tokens = ref
    logits = [r[0] for r in results if r[0] is not None]
    assert len(logits) == 1, "exactly one rank (the last stage's tp rank 0) returns logits"
    assert_logits_close(logits[0], ref_logits, Batch.from_lists(prompts).valid)
    knowing = [r[1] for r in results if r[1] is not None]
    assert knowing, "no rank reported tokens"
    for tokens in knowing:
        assert tokens == ref_tokens


@pytest.mark.parametrize("tp,counts,m", [
    (1, (15, 15), 2),       # (1, 2)
    (1, (10, 10, 10), 3),   # (1, 3), one micro-batch per stage
    (2, (15, 15), 4),       # (2, 2): 9 heads split 5/4 inside each stage, one sequence per micro-batch
    (3, (30,), 1),          # (3, 1): tensor parallel only, through the same helper
    (1, (20, 10), 2),       # uneven stages
    (2, (20, 10), 1),       # uneven stages, no micro-batching
])
def test_bundled_model(bundled_dir, bundled_prompts, bundled_ref, tp, counts, m):
    _check(_run(bundled_dir, bundled_prompts, 12, tp, counts, m), bundled_ref, bundled_prompts)


def _random_prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name,tp,counts,m", [
    ("gqa12x4", 1, (1, 1, 1), 3),   # one layer per stage, vocab 1001
    ("gqa12x4", 2, (2, 1), 2),      # uneven hybrid
    ("qwen2", 2, (1, 1), 3),        # tied embeddings: the last stage reads its head from the embedding tensor
    ("mistral_window", 1, (1, 1), 2),  # sliding window shorter than the prompts
])
def test_random_models(random_dirs, name, tp, counts, m):
    folder = random_dirs[name]
    prompts = _random_prompts(hf_model(folder).config.vocab_size, [37, 12, 25])
    _check(_run(folder, prompts, 10, tp, counts, m), hf_logits_and_tokens(hf_model(folder), prompts, 10), prompts)


def test_stage_builds_only_its_layers(random_dirs):
    results = _run(random_dirs["qwen2"], [[5, 6, 7]], 2, 1, (1, 1), 1)
    first, last = results[0][3], results[1][3]
    assert "model.embed_tokens.weight" in first and not any("layers.1." in n or "lm_head" in n for n in first)
    assert "lm_head.weight" in last and "model.norm.weight" in last
    assert not any("layers.0." in n or "embed_tokens" in n for n in last)


def test_sampled_tokens_do_not_depend_on_the_layout(random_dirs):
    """Each sequence draws from its own seeded generator: same tokens for any tp, pp and micro-batching."""
    folder = random_dirs["gqa12x4"]
    prompts = _random_prompts(1001, [9, 14, 5, 11])
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=5)
    plain = _run(folder, prompts, 8, 1, (3,), 1, sampling)[0][1]
    piped = _run(folder, prompts, 8, 1, (2, 1), 3, sampling)
    assert piped[0][1] == plain and piped[1][1] == plain
