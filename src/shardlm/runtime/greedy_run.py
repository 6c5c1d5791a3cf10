"""Greedy decode runs of a one-rank CPU model in one compiled call (csrc/kernels.cpp: greedy_run).

A step of several decode tokens (Step.repeat) took each token after the first through Python: the step's tensors
(tokens, positions, the mask, the cache's run), the model's forward (embedding, rotary rows, the DecodeStack call, the
final norm, the LM head) and the sampler. On the bundled int4 model that was about 0.4 ms of a 2.7 ms token, measured
in-process: little of it arithmetic, most of it torch ops and Python run on caches the weights had just flushed (the
final norm took 47-64 us right after the stack and 12 us when called again).

The compiled run takes each greedy token through the same ops in the same order, and its rotary rows come from a
table the same function (rope_cos_sin) computed for every position, so its tokens and the cache's contents are the
Python path's bit for bit (tests/unit/test_greedy_run.py). It applies to a rank that holds the whole model on the
CPU with the fused stack (tensor parallel 1, one stage), an int8 or plain embedding, an int8, int4 or plain head,
and steps whose rows are all greedy without logprobs. A step of decode rows only takes every run in the call, its
first included (a server's single steps too); a step with prompts takes the runs after its first. Decode rows that
sample or ask for logprobs take the same path one step at a time (`GreedyRuns.logits`, csrc/kernels.cpp
decode_logits): its logits, which the rank then samples as the Python step would.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels.linear import GEMV_MAX_ROWS
from shardlm.models.llama import RMSNorm, rope_cos_sin
from shardlm.quant import Int4Weight, Int8Embedding, Int8Weight
from shardlm.runtime.work import Decode

TABLE_ALIGN = 32
"""The rotary rows come from a table only where a row's head_dim values fill whole vector pairs of torch's elementwise
cos and sin (16 lanes on AVX-512, 8 on AVX2), elsewhere from rope_cos_sin's own ops on each token's shapes. A guard,
not a need shown here: torch 2.13 gave each element the same cos and sin wherever it sat in the tensor (a review
checked its AVX-512, AVX2 and default kernels, shifted starts and 1-3 threads), but a build whose vector loop and scalar
tail rounded differently would then still give a table row the step's values."""
TABLE_BLOCK = 16384
"""Values of the table computed per call: below torch's parallel grain (32768), so every call runs on one thread from
its first value, as a step's does (the same guard)."""


def rope_table(inv_freq: torch.Tensor, max_len: int, head_dim: int, dtype: torch.dtype):
    """(cos, sin), each (max_len, head_dim) in `dtype`: rope_cos_sin's rows of every position, in blocks."""
    rows = max(1, TABLE_BLOCK // head_dim)
    cos, sin = [], []
    for start in range(0, max_len, rows):
        c, s = rope_cos_sin(inv_freq, torch.arange(start, min(max_len, start + rows))[:, None], dtype)  # (n, 1, 1, hd)
        cos.append(c.reshape(-1, head_dim)), sin.append(s.reshape(-1, head_dim))
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def _embedding(module: nn.Module, gm) -> bool:
    """Fill gm's embedding fields from `module`; False when it is a kind the run does not take."""
    if isinstance(module, Int8Embedding) and module.ctx is None and module.start == 0 \
            and not module.kernel_weight.interleaved:
        kw = module.kernel_weight
        gm.embed_q, gm.embed_scale, gm.embed_width, gm.embed_paired = kw.q, kw.scale, kw.in_features, kw.paired
        return True
    if type(module) is nn.Embedding and module.weight.is_contiguous():
        gm.embed_weight = module.weight.detach()
        return True
    return False


def _head(module: nn.Module, gm) -> bool:
    """Fill gm's head fields from the LM head; False when it is a kind the run does not take."""
    if getattr(module, "bias", None) is not None or getattr(module, "gemv", None) is None:
        return False
    kw = getattr(module, "kernel_weight", None)
    if isinstance(kw, Int8Weight) and kw.gemv is not None and not kw.interleaved:  # natural or paired codes
        gm.head_q, gm.head_scale, gm.head_exact, gm.head_paired = kw.q, kw.scale, kw.exact, kw.paired
        return True
    if isinstance(kw, Int4Weight) and kw.gemv is not None and not kw.packed.is_cuda:
        gm.head4_codes, gm.head4_sz, gm.head4_pad_left, gm.head4_rows = kw.kernel_args()
        gm.head_exact = kw.exact
        return True
    weight = getattr(module, "weight", None)
    if kw is None and weight is not None and weight.is_contiguous() and weight.dtype in (torch.float32, torch.bfloat16):
        gm.head_weight = weight.detach()
        return True
    return False


class GreedyRuns:
    """A SlotRunner's compiled greedy runs, when its rank can take them (`GreedyRuns.of`)."""

    def __init__(self, model: nn.Module, cache, window: int | None, gm):
        self.model, self.cache, self.window, self.gm = model, cache, window, gm

    @classmethod
    def of(cls, rank, cache, window: int | None) -> "GreedyRuns | None":
        """The runs for a rank (RankModel) and its SlotCache, or None where they do not apply."""
        ops, model = rank.ops, rank.module
        if ops is None or not hasattr(ops, "greedy_run") or rank.device.type != "cpu":
            return None
        if getattr(model, "decode_stack", None) is None or not (rank.spec.first_stage and rank.spec.last_stage):
            return None
        if type(model.model.norm) is not RMSNorm or model.model.embed_tokens is None or model.lm_head is None:
            return None  # (the compiled run computes this RMSNorm's forward and no other)
        gm = ops.GreedyModel()
        if not _embedding(model.model.embed_tokens, gm) or not _head(model.lm_head, gm):
            return None
        gm.like, gm.inv_freq = torch.empty(0, dtype=rank.dtype), model.inv_freq.contiguous()
        gm.norm_weight, gm.norm_eps = model.model.norm.weight.detach(), float(model.model.norm.eps)
        return cls(model, cache, window, gm)

    def _tables(self) -> None:
        """The rotary table, built on the first run (a rank that never runs several tokens a step holds none)."""
        hd = self.model.args.head_dim
        if hd % TABLE_ALIGN == 0 and self.gm.cos_table is None:
            self.gm.cos_table, self.gm.sin_table = rope_table(self.model.inv_freq, self.cache.max_len, hd,
                                                              self.gm.like.dtype)

    def applies(self, decodes: list[Decode], first: int, runs: int) -> bool:
        """Whether runs first .. first + runs - 1 of these rows (run i feeding row d at d.position + i) can run
        compiled: all greedy, no logprobs, few rows, room in the cache."""
        return 0 < len(decodes) <= GEMV_MAX_ROWS and runs > 0 \
            and all(d.params.temperature == 0 and d.logprobs is None for d in decodes) \
            and max(d.position for d in decodes) + first + runs - 1 < self.cache.max_len

    def logits(self, decodes: list[Decode], feeds: list[int]) -> torch.Tensor | None:
        """One step of any decode rows (sampled, greedy, with logprobs), row j feeding `feeds[j]` at its position:
        the logits (rows, 1, vocab) float32 the Python step computes, bit for bit, from the compiled path (a sampling
        row then skips the step's Python: ~0.5 ms of a 16-row float32 step); None where the rows or the stack do not
        take the call."""
        if not 0 < len(decodes) <= GEMV_MAX_ROWS or max(d.position for d in decodes) >= self.cache.max_len:
            return None
        out = self._call("decode_logits", decodes, feeds, 0)  # (rows, vocab)
        return None if out is None else out[:, None]

    def _call(self, op: str, decodes: list[Decode], feeds: list[int], first: int, *extra):
        """The stack's compiled `op` (greedy_run or decode_logits) on these rows, row j feeding `feeds[j]` at its
        position + first; None where a block's fused step was replaced (no compiled stack)."""
        stack = self.model.decode_stack
        kernel = stack.current() if stack is not None else None
        if kernel is None:
            return None
        self._tables()
        caches = [(self.cache.k[i], self.cache.v[i]) for i in stack.ids]
        slots, positions = [d.slot for d in decodes], [d.position + first for d in decodes]
        return getattr(stack.ops, op)(kernel, self.gm, caches, torch.tensor(feeds), torch.tensor(slots),
                                      torch.tensor(positions), self.window or 0, *extra)

    def tokens(self, decodes: list[Decode], feeds: list[int], first: int, runs: int) -> list[list[int]] | None:
        """Tokens (runs, rows) of runs first .. first + runs - 1, feeding row j `feeds[j]` at its position + first;
        None when the rows (`applies`) or the stack (a block's fused step replaced) do not take the call: the caller
        then runs the tokens one by one."""
        if not self.applies(decodes, first, runs):
            return None
        out = self._call("greedy_run", decodes, feeds, first, runs)  # (runs, rows)
        return None if out is None else out.tolist()
