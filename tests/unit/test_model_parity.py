"""Single-device model (tp 1, in process) against transformers on the same checkpoints."""

import pytest
import torch

from conftest import RANDOM_MODELS, hf_model
from refs import assert_logits_close, hf_logits_and_tokens, shardlm_rank
from shardlm.runtime.step import Batch


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 23, 31)]


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_random_model_matches_transformers(name, random_dirs):
    folder = random_dirs[name]
    ref_model = hf_model(folder)
    prompts = _prompts(ref_model.config.vocab_size)
    ref_logits, ref_tokens = hf_logits_and_tokens(ref_model, prompts, 16)
    logits, tokens, _ = shardlm_rank(0, 1, str(folder), prompts, 16, False)
    assert_logits_close(logits, ref_logits, Batch.from_lists(prompts).valid)
    assert tokens == ref_tokens


def test_bundled_model_matches_transformers(bundled_dir, prompt64):
    ref_logits, ref_tokens = hf_logits_and_tokens(hf_model(bundled_dir), [prompt64], 32)
    logits, tokens, _ = shardlm_rank(0, 1, str(bundled_dir), [prompt64], 32, False)
    assert_logits_close(logits, ref_logits, torch.ones(1, 64, dtype=torch.bool))
    assert tokens == ref_tokens
