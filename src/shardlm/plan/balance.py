"""Layer counts per pipeline stage: balance predicted stage time without exceeding any stage's memory.

Stage s costs `fixed[s] + n_s * per_layer[s]` seconds and holds at most `cap[s]` layers. Layers are
handed out one at a time to the stage whose time would grow the least (water filling), so faster
or larger devices get more layers, and a full stage gets no more.
"""

from __future__ import annotations


def assign_layers(n_layers: int, per_layer: list[float], fixed: list[float], cap: list[int]) -> list[int] | None:
    """Layers per stage (each at least 1), or None when the stages cannot hold n_layers between them."""
    p = len(per_layer)
    if p > n_layers or sum(min(c, n_layers) for c in cap) < n_layers or any(c < 1 for c in cap):
        return None
    counts = [1] * p
    for _ in range(n_layers - p):
        best, best_t = -1, 0.0
        for s in range(p):
            if counts[s] >= cap[s]:
                continue
            t = fixed[s] + (counts[s] + 1) * per_layer[s]
            if best < 0 or t < best_t:
                best, best_t = s, t
        counts[best] += 1
    return counts
