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


@pytest.mark.parametrize("hq,hkv,dtype", [(9, 3, torch.float32), (32, 8, torch.float32), (8, 1, torch.bfloat16),
                                          (4, 4, torch.float32)])
def test_folded_decode_attention_equals_attention_per_query_head(hq, hkv, dtype):
    """Decode attention with a KV head's query heads folded into query positions (models/llama.py
    grouped_attention, one position a row) gives what each query head attending its own KV head gives, under
    per-row masks with holes; a row's output does not depend on the rows beside it to within rounding."""
    from shardlm.models.llama import grouped_attention

    g = torch.Generator().manual_seed(3)
    b, t, hd = 5, 37, 16
    q = torch.randn(b, hq, 1, hd, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, t, hd, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(b, 1, 1, t, generator=g) < 0.7
    mask[..., 0] = True  # every row sees at least one key
    kv_map = torch.tensor([h // (hq // hkv) for h in range(hq)])
    folded = grouped_attention(q, k, v, kv_map, mask, True)  # (b, hq, 1, hd)
    keys, values = k.float()[:, kv_map], v.float()[:, kv_map]  # (b, hq, t, hd): query head h's own KV head
    scores = (q.float() @ keys.transpose(-1, -2) / hd ** 0.5).masked_fill(~mask, float("-inf"))  # (b, hq, 1, t)
    ref = (torch.softmax(scores, -1) @ values)[:, :, 0]  # (b, hq, hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert folded.shape == (b, hq, 1, hd) and folded.dtype == dtype
    torch.testing.assert_close(folded[:, :, 0].float(), ref, atol=tol, rtol=tol)
    alone = grouped_attention(q[2:3], k[2:3], v[2:3], kv_map, mask[2:3], True)
    torch.testing.assert_close(alone.float(), folded[2:3].float(), atol=tol, rtol=tol)
