"""Perplexity of a model on a text: how much a dtype or a quantization costs in quality.

The text is tokenized once and cut into consecutive windows of `window` tokens; each window is
scored on its own (no cache carried between windows), every token after the window's first
predicted from the tokens before it. Perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlm.models.source import ModelSource
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import RankSpec
from shardlm.runtime.build import build_rank_model
from shardlm.settings import Settings
from shardlm.runtime.step import attention_mask, model_device, positions_for


def default_text() -> str:
    """The public-domain text shipped with shardlm (see shardlm/data/README.md)."""
    return resources.files("shardlm").joinpath("data/eval_text.txt").read_text()


@dataclass
class PerplexityResult:
    """Scores of one run."""

    perplexity: float
    nll: float
    """Mean negative log-likelihood per scored token (nats)."""
    tokens: int
    """Tokens scored (predicted)."""
    windows: int
    seconds: float
    weight_bytes: int


def score(model, ids: list[int], window: int, max_seq_len: int) -> tuple[float, int, int]:
    """(sum of NLL, tokens scored, windows) of `ids` under `model` in windows of `window` tokens."""
    window = max(2, min(window, max_seq_len))
    device = model_device(model)
    total, count, n = 0.0, 0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]])  # (1, s)
        if chunk.shape[1] < 2:
            break
        valid = torch.ones_like(chunk, dtype=torch.bool)
        mask = attention_mask(valid, 0, chunk.shape[1], model.args.sliding_window)  # (1, 1, s, s)
        with torch.inference_mode():
            logits = model(chunk.to(device), positions_for(valid).to(device), mask.to(device))  # (1, s, vocab) float32
        nll = F.cross_entropy(logits[0, :-1].cpu(), chunk[0, 1:], reduction="sum")
        total, count, n = total + float(nll), count + chunk.shape[1] - 1, n + 1
    return total, count, n


def perplexity(source: ModelSource, text: str, tokenizer, dtype: str = "float32", quantization: str | None = None,
               window: int = 512, device: str = "cpu", settings: Settings | None = None,
               embedding: str = "float") -> PerplexityResult:
    """Perplexity of the model in `source` (loaded on one rank on `device`, its embedding held as `embedding`:
    float or int8) on `text`."""
    t0 = time.perf_counter()
    spec = RankSpec.single(source.args.n_layers, dtype, quantization or "none", "cuda" if device != "cpu" else "cpu")
    spec = replace(spec, embedding=embedding)
    rank = build_rank_model(spec, source, ParallelContext(), settings, device)
    ids = tokenizer(text)["input_ids"]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    total, count, n = score(rank.module, ids, window, source.args.max_seq_len)
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, n, time.perf_counter() - t0, rank.resident_bytes())
