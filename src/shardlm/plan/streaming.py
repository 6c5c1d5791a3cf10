"""Which of a rank's layers stream in under a memory budget, and what it then holds (torch-free).

One rule for the planner's predictions, the plan built from `--memory-budget`, and (through the
RankSpec) the rank that streams: keep the embedding, final norm and LM head plus the stage's first
layers resident while they fit the budget together with the read buffers, and stream the stage's
last layers. When even streaming every layer does not fit (a budget below the embedding or head),
the float embedding / head is also used in place from the offload file, a block of rows at a time
(disk tier only: a GPU rank keeps them on the device).

Bytes come from `plan.memory.ShardWeights`, the same slicing rules and quantized formats the loader
uses, so a rank's resident weights are what this predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.plan.memory import ShardWeights, stage_weight_bytes
from shardlm.plan.plan import PlanError

VOCAB_CHUNK = 4 * 2**20
"""Bytes of LM-head rows mapped at a time when the head is used in place from the offload file."""
MiB = 2**20


class BudgetError(PlanError):
    """A memory budget too small to run with; names the minimum and the alternatives."""


def vocab_chunk(head_bytes: int) -> int:
    """Bytes of LM-head rows mapped at a time: VOCAB_CHUNK, or an eighth of a smaller head."""
    return min(VOCAB_CHUNK, max(1, head_bytes // 8))


def vocab_bytes(w: ShardWeights, first: bool, last: bool, quantized: bool) -> list[int]:
    """Sizes of the float vocabulary tensors a stage could use in place: its embedding, and a head that
    is a separate float tensor (a tied head held as a copy, or an untied one left unquantized)."""
    out = [w.embed] if first else []
    if last and not (w.tied and first) and (w.tied or not quantized):
        out.append(w.head)
    return out


@dataclass(frozen=True)
class StreamFit:
    """How one rank fits its budget."""

    streamed: int
    """The stage's last `streamed` layers stream in."""
    vocab: bool
    """The embedding / float head is used in place from the offload file."""
    resident: int
    """Weight bytes held: embedding/norm/head (or a block of rows), resident layers, read buffers."""


def resident_bytes(w: ShardWeights, n_layers: int, first: bool, last: bool, streamed: int, vocab: bool,
                   buffers: int, quantized: bool) -> int:
    """Weight bytes a rank holds when its stage's last `streamed` of `n_layers` layers stream through
    `buffers` read buffers, and (`vocab`) its float vocabulary tensors are used in place."""
    total = stage_weight_bytes(w, n_layers - streamed, first, last) + streamed * w.layer_fixed
    if streamed:
        total += min(buffers, streamed) * w.layer_streamed
    if vocab:
        sizes = vocab_bytes(w, first, last, quantized)
        total += vocab_chunk(max(sizes, default=1)) - sum(sizes)
    return total


def fit_budget(w: ShardWeights, n_layers: int, first: bool, last: bool, budget: int, prefetch: bool,
               quantized: bool, vocab_ok: bool = True) -> StreamFit:
    """The fewest streamed layers (and the vocabulary in place only if needed) that fit `budget` bytes;
    BudgetError when even streaming every layer does not fit."""
    buffers = 2 if prefetch else 1
    if stage_weight_bytes(w, n_layers, first, last) <= budget:
        return StreamFit(0, False, stage_weight_bytes(w, n_layers, first, last))
    vocab = False
    minimum = resident_bytes(w, n_layers, first, last, n_layers, False, buffers, quantized)
    minimum += (buffers - min(buffers, n_layers)) * w.layer_streamed  # read buffers are allocated whole
    sizes = vocab_bytes(w, first, last, quantized)
    if budget < minimum and sizes and vocab_ok:
        vocab = True
        minimum += vocab_chunk(max(sizes)) - sum(sizes)
    if budget < minimum:
        kept = "norms + a vocabulary chunk" if vocab else "embedding/norm/head"
        raise BudgetError(
            f"--memory-budget {budget / MiB:.1f}MB is below the {minimum / MiB:.1f} MiB this rank needs at least: "
            f"{(minimum - buffers * w.layer_streamed) / MiB:.1f} MiB {kept} and norms kept in memory + {buffers} "
            f"read buffer(s) of a layer ({w.layer_streamed / MiB:.1f} MiB); use --memory-budget "
            f"{-(-minimum // MiB)}MB or more, add ranks "
            "(--tp/--pp), or quantize (--quantization int8|int4)")
    resident_layers = min(n_layers, (budget - minimum) // max(w.layer_streamed, 1))
    streamed = n_layers - resident_layers
    return StreamFit(streamed, vocab, resident_bytes(w, n_layers, first, last, streamed, vocab, buffers, quantized))
