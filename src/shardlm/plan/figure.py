"""Draw a Plan as one picture: predicted memory per device (left) and which layers run where (right).

The memory panel stacks weights, KV cache, activations and overhead per rank against the device's
capacity; a rank over capacity gets a red outline and says by how much. The layer panel draws each
pipeline stage as a block spanning its layer range (layer 0 at the top), labelled with its layers,
its devices in replica 0 and its offloaded layers.

matplotlib is imported only inside `draw_plan`, so the rest of shardlm does not need it. The figure is
built on `matplotlib.figure.Figure` directly rather than through pyplot: no backend is switched, no
window can open, and no global figure registry is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from shardlm.atomic import atomic_file
from shardlm.plan.plan import Plan, RankMemory

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
"""Output suffix -> matplotlib format."""
MAX_BARS = 32
"""Above this many ranks, show replica 0 only and merge runs of identical ranks into one bar.
32 bars at 6 inches leave about 13 pt per bar, room for an 8 pt label."""
GIB = 2**30
KINDS = (("weights", "weights", "#4c72b0"), ("kv_cache", "KV cache", "#dd8452"),
         ("activations", "activations", "#55a868"), ("overhead", "overhead", "#8172b3"))
"""(RankMemory field, legend label, colour) of each stacked segment, left to right."""
FREE_COLOR = "#ececec"
OVER_COLOR = "#d62728"


@dataclass(frozen=True)
class MemoryBar:
    """One bar of the memory panel: one rank, or a run of ranks with identical predictions."""

    ranks: tuple[int, ...]
    """Global ranks the bar stands for."""
    devices: tuple[str, ...]
    """Their device addresses, same order."""
    stages: frozenset[int]
    """Pipeline stages they belong to."""
    memory: RankMemory
    """The first rank's prediction (all ranks of the bar share its numbers)."""

    @property
    def label(self) -> str:
        """'rank 0  0:0 H100-80GB', or 'ranks 0-7  0:0-0:7 H100-80GB' for a run."""
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {self.ranks[0]}-{self.ranks[-1]}"
        return f"{who}  {compress_devices(self.devices)} {self.memory.device_name}"


def draw_plan(plan: Plan, path: str | Path) -> Path:
    """Draw `plan` to `path` (.png, .svg or .pdf) and return the path.

    Needs `plan.predictions`. The file is written to a temporary name in the same folder, synced,
    then renamed, so a reader never sees half a picture.
    """
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot draw a plan to {path.name!r}: the suffix must be one of "
                         f"{', '.join(FORMATS)}")
    if plan.predictions is None:
        raise ValueError("plan has no predictions; make it with `shardlm plan`")
    if not plan.predictions.memory:
        raise ValueError("plan predictions list no memory per rank; make the plan again with `shardlm plan`")
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none", "pdf.fonttype": 42}):  # text stays text
        fig = _figure(plan)
        _save_atomic(fig, path, fmt)
    return path


def compress_devices(devices: tuple[str, ...] | list[str], max_runs: int = 3) -> str:
    """Device addresses with consecutive indices on one node written as a run: '0:0-0:7, 1:0'.

    Addresses that are not 'node:index' stand alone; after `max_runs` runs the rest is '...'.
    """
    runs: list[list[str]] = []  # each run: [first, last]
    for dev in devices:
        if runs and _follows(runs[-1][1], dev):
            runs[-1][1] = dev
        else:
            runs.append([dev, dev])
    parts = [a if a == b else f"{a}-{b}" for a, b in runs]
    return ", ".join(parts[:max_runs]) + (", ..." if len(parts) > max_runs else "")


def _follows(prev: str, dev: str) -> bool:
    """True when `dev` is the next index on the same node as `prev`."""
    p_node, _, p_idx = prev.rpartition(":")
    d_node, _, d_idx = dev.rpartition(":")
    return p_node == d_node and p_idx.isdigit() and d_idx.isdigit() and int(d_idx) == int(p_idx) + 1


def memory_bars(plan: Plan) -> tuple[list[MemoryBar], str]:
    """The bars the memory panel draws, and a note for its title ('' when every rank is shown).

    Up to MAX_BARS ranks: one bar each. More: replica 0 only, runs of identical ranks within a
    stage merged, and if still too many, identical runs merged across stages.
    """
    layout, memory = plan.layout, plan.predictions.memory
    bars = [MemoryBar((m.rank,), (m.device,), frozenset({layout.coord(m.rank).stage}), m) for m in memory]
    if len(bars) <= MAX_BARS:
        return bars, ""
    shown = [b for b in bars if layout.coord(b.ranks[0]).replica == 0]
    merged = _merge(shown, across_stages=False)
    if len(merged) > MAX_BARS:
        merged = _merge(merged, across_stages=True)
    notes = []
    if layout.dp > 1:
        notes.append(f"replica 0 of {layout.dp} shown")
    if len(merged) < len(shown):
        notes.append("identical ranks merged")
    hidden_over = sum(1 for b in bars if layout.coord(b.ranks[0]).replica > 0 and _over(b.memory) > 0)
    if hidden_over:
        notes.append(f"{hidden_over} hidden rank{'s' * (hidden_over > 1)} over capacity")
    return merged, "; ".join(notes)


def _merge(bars: list[MemoryBar], across_stages: bool) -> list[MemoryBar]:
    """Merge consecutive bars whose predictions are identical (and, unless across_stages, same stage)."""
    out: list[MemoryBar] = []
    for bar in bars:
        prev = out[-1] if out else None
        if prev is not None and _same(prev.memory, bar.memory) and (across_stages or prev.stages == bar.stages):
            out[-1] = MemoryBar(prev.ranks + bar.ranks, prev.devices + bar.devices,
                                prev.stages | bar.stages, prev.memory)
        else:
            out.append(bar)
    return out


def _same(a: RankMemory, b: RankMemory) -> bool:
    """Identical predicted numbers on the same device type."""
    key = ("weights", "kv_cache", "activations", "overhead", "capacity", "offloaded", "device_name")
    return all(getattr(a, k) == getattr(b, k) for k in key)


def _over(m: RankMemory) -> int:
    """Bytes over capacity (0 when it fits)."""
    return max(m.total - m.capacity, 0)


def _figure(plan: Plan):
    """The two-panel figure with its suptitle.

    Text beside bars and blocks is placed after the layout is fixed, measured with the renderer,
    and fitted: the memory axis widens to hold its labels, stage labels wrap or shrink to their room.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6), dpi=120)
    FigureCanvasAgg(fig)  # a renderer to measure text with; savefig still picks the canvas by format
    mem_ax, layer_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    colors = _stage_colors(plan.layout.pp)
    texts = _draw_memory(mem_ax, plan, colors)
    _draw_layers(layer_ax, plan, colors)
    fig.suptitle(_title(plan), fontsize=11)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    _fit_xlim(mem_ax, texts, renderer)
    _label_stages(layer_ax, plan, renderer)
    return fig


def _stage_colors(pp: int) -> list:
    """One colour per pipeline stage: tab10 up to 10 stages, tab20 up to 20, else viridis."""
    from matplotlib import colormaps

    if pp <= 10:
        return [colormaps["tab10"](i) for i in range(pp)]
    if pp <= 20:
        return [colormaps["tab20"](i) for i in range(pp)]
    return [colormaps["viridis"](i / (pp - 1)) for i in range(pp)]


def _title(plan: Plan) -> str:
    """Two lines: model, numerics and layout; then the predicted speed and the budget it assumes."""
    lay, perf = plan.layout, plan.predictions.performance
    numerics = plan.dtype + (f", {plan.quantization} weights" if plan.quantization != "none" else "")
    line1 = (f"{plan.model.name}  |  {numerics}  |  tp={lay.tp} pp={lay.pp} dp={lay.dp} "
             f"({lay.world} rank{'s' if lay.world > 1 else ''} on {plan.cluster})")
    line2 = (f"predicted decode: {perf.decode_tokens_per_s:,.0f} tok/s "
             f"({perf.single_stream_tokens_per_s:,.0f} single-stream), "
             f"{perf.decode_latency_s * 1e3:,.1f} ms per step  |  "
             f"batch {plan.kv.max_batch} x {plan.kv.max_seq_len} tokens")
    return f"{line1}\n{line2}"


def _draw_memory(ax, plan: Plan, colors: list) -> list:
    """Stacked horizontal memory bars per rank against capacity, over-capacity ranks outlined in red.

    Returns the text artists right of the bars, for `_fit_xlim`.
    """
    bars, note = memory_bars(plan)
    ys = list(range(len(bars)))
    mems = [b.memory for b in bars]
    left = [0.0] * len(bars)
    for field_name, label, color in KINDS:
        widths = [getattr(m, field_name) / GIB for m in mems]
        ax.barh(ys, widths, left=left, height=0.7, color=color, label=label)
        left = [a + w for a, w in zip(left, widths)]
    free = [max(m.capacity / GIB - t, 0.0) for m, t in zip(mems, left)]
    ax.barh(ys, free, left=left, height=0.7, color=FREE_COLOR, edgecolor="#bbbbbb", linewidth=0.5,
            label="free")
    caps = [m.capacity / GIB for m in mems]
    ax.vlines(caps, [y - 0.45 for y in ys], [y + 0.45 for y in ys], colors="black", linewidth=1.6,
              label="capacity")
    xmax = max(max(caps), max(left))
    fontsize = 8 if len(bars) <= 16 else 7
    texts = _annotate_memory(ax, ys, mems, left, xmax, fontsize)
    _memory_axes(ax, bars, colors, fontsize, xmax, note)
    return texts


def _annotate_memory(ax, ys, mems, totals, xmax, fontsize) -> list:
    """Right of each bar: 'used / capacity', and 'over by X GiB' with a red outline where it does not fit."""
    texts = []
    for y, m, total in zip(ys, mems, totals):
        over = _over(m) / GIB
        text = f"{total:,.1f} / {m.capacity / GIB:,.1f}"
        if m.offloaded:
            text += f"  (+{m.offloaded / GIB:,.1f} offloaded)"
        x = max(total, m.capacity / GIB) + xmax * 0.01
        if over > 0:
            ax.barh(y, total, height=0.7, fill=False, edgecolor=OVER_COLOR, linewidth=2)
            text = f"over by {over:,.1f} GiB  ({text})"
        texts.append(ax.text(x, y, text, va="center", ha="left", fontsize=fontsize, in_layout=False,
                             color=OVER_COLOR if over > 0 else "#333333",
                             fontweight="bold" if over > 0 else "normal"))
    return texts


def _fit_xlim(ax, texts: list, renderer) -> None:
    """Widen the x axis until every text right of a bar ends inside the axes.

    A text starting at data x0 and w pixels wide fits when x0 * W / xlim + w <= W (W: axes width).
    """
    width = ax.get_window_extent(renderer).width
    need = ax.get_xlim()[1]
    for t in texts:
        w = t.get_window_extent(renderer).width + 8  # 8 px breathing room
        need = max(need, t.get_position()[0] * width / max(width - w, width * 0.2))
    ax.set_xlim(0, need)


def _memory_axes(ax, bars: list[MemoryBar], colors: list, fontsize: float, xmax: float, note: str) -> None:
    """Tick labels coloured by stage, stage separators, limits, legend and title of the memory panel."""
    ax.set_yticks(range(len(bars)), [b.label for b in bars], fontsize=fontsize)
    for tick, bar in zip(ax.get_yticklabels(), bars):
        if len(bar.stages) == 1 and len(colors) > 1:
            tick.set_color(_darker(colors[next(iter(bar.stages))]))
    for y, (a, b) in enumerate(zip(bars, bars[1:])):
        if a.stages != b.stages:
            ax.axhline(y + 0.5, color="#999999", linewidth=0.6, linestyle=":")
    ax.set_ylim(len(bars) - 0.5, -0.5)  # rank 0 at the top
    ax.set_xlim(0, xmax * 1.05)  # widened by _fit_xlim to hold the text right of the bars
    ax.set_xlabel("GiB", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    over = sum(len(b.ranks) for b in bars if _over(b.memory) > 0)
    title = "Memory per device (predicted)" + (f": {over} rank{'s' * (over > 1)} over capacity" if over else "")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10,
                 color=OVER_COLOR if over else "black")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=6, fontsize=8, frameon=False)


def _darker(color, factor: float = 0.75):
    """`color` (RGBA) darkened so it reads as text on white."""
    return tuple(c * factor for c in color[:3])


def _draw_layers(ax, plan: Plan, colors: list) -> None:
    """Each pipeline stage as a block over its layer range (layer 0 at the top), labelled beside it."""
    lay = plan.layout
    offloaded = plan.offload.layers if plan.offload.tier != "none" else ()
    for s, (a, b) in enumerate(lay.stage_layers):
        ax.bar(s, b - a, bottom=a, width=0.8, color=colors[s], edgecolor="black", linewidth=0.6)
        k = offloaded[s] if s < len(offloaded) else 0
        if k:  # offloaded layers drawn as the hatched tail of the block
            ax.bar(s, k, bottom=b - k, width=0.8, fill=False, hatch="///", edgecolor="black", linewidth=0)
    ax.set_xlim(-0.6, lay.pp - 0.4)
    ax.set_ylim(lay.n_layers, 0)  # layer 0 at the top
    step = max(1, math.ceil(lay.pp / 16))
    ax.set_xticks(range(0, lay.pp, step))
    ax.tick_params(labelsize=8)
    ax.set_xlabel("pipeline stage", fontsize=9)
    ax.set_ylabel("decoder layer", fontsize=9)
    where = f" (replica 0 of {lay.dp})" if lay.dp > 1 else ""
    ax.set_title(f"Layer-to-device map{where}", fontsize=10)
    if any(offloaded):
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch="///",
                                 label=f"layers offloaded to {plan.offload.tier}")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=8, frameon=False)


def _label_stages(ax, plan: Plan, renderer) -> None:
    """Label each stage beside its block, on the side with more columns free.

    The blocks form a staircase, so beside a block, at its own layer rows, the axes are empty. Each
    label takes the best fitting of a few wrappings and font sizes (see `_fit_label`); with very many
    stages only every k-th is labelled.
    """
    lay = plan.layout
    box = ax.get_window_extent(renderer)
    col_px = box.width / (lay.pp + 0.2)  # xlim spans pp + 0.2 columns
    heights = [(b - a) * box.height / lay.n_layers for a, b in lay.stage_layers]
    fontsize = 8 if lay.pp <= 8 else (7 if lay.pp <= 16 else 6)
    line_px = fontsize * 1.3 * ax.figure.dpi / 72
    every = max(1, math.ceil(line_px * 1.2 / min(heights)))
    for s, (a, b) in enumerate(lay.stage_layers):
        if s % every:
            continue
        right, left = lay.pp - 1 - s, s  # free columns on each side
        if lay.pp == 1:
            x, ha, room = 0.0, "center", box.width
        elif right >= left:
            x, ha, room = s + 0.45, "left", (right + 0.15) * col_px
        else:
            x, ha, room = s - 0.45, "right", (left + 0.15) * col_px
        text = ax.text(x, (a + b) / 2, "", ha=ha, va="center",
                       bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1.5})
        budget = heights[s] if every == 1 else line_px  # one row when sparse: taller ones hit the next blocks
        _fit_label(text, _stage_lines(plan, s), room, budget, fontsize, renderer)


def _fit_label(text, lines: list[tuple[str, ...]], room_px: float, height_px: float, fontsize: float,
               renderer) -> None:
    """Set `text` to the candidate that fits `room_px` wide, shows most lines whole, in the largest font.

    Each line is a tuple of parts joined by a space; a line too wide for the room may wrap, one part
    per row. Candidates: three font sizes, each with and without wrapping.
    """
    dpi = text.figure.dpi
    best = None
    for size in (fontsize, fontsize - 1, fontsize - 2):
        text.set_fontsize(size)
        max_rows = max(1, int(height_px / (size * 1.4 * dpi / 72)))  # 1.2 line spacing plus box padding
        for wrap in (False, True):
            rows, whole = _rows(lines, max_rows, lambda line: wrap and _width(text, line, renderer) > room_px)
            fits = _width(text, "\n".join(rows), renderer) <= room_px
            key = (fits, whole, size, not wrap)
            if best is None or key > best[0]:
                best = (key, rows, size)
    text.set_text("\n".join(best[1]))
    text.set_fontsize(best[2])


def _width(text, content: str, renderer) -> float:
    """Pixel width of `text` showing `content`, plus its box padding."""
    text.set_text(content)
    return text.get_window_extent(renderer).width + 6


def _rows(lines: list[tuple[str, ...]], max_rows: int, wraps) -> tuple[list[str], int]:
    """Text rows of `lines`, up to `max_rows`, wrapping a line where `wraps(joined line)`; and how many
    lines are shown whole."""
    rows: list[str] = []
    whole = 0
    for parts in lines:
        joined = " ".join(parts)
        new = list(parts) if wraps(joined) else [joined]
        if len(rows) + len(new) > max_rows:
            break
        rows += new
        whole += 1
    return (rows or [" ".join(lines[0])]), whole


def _stage_lines(plan: Plan, s: int) -> list[tuple[str, ...]]:
    """The label of stage `s`, most important line first; each line split where it may wrap."""
    lay = plan.layout
    a, b = lay.stage_layers[s]
    lines = [(f"stage {s}:", f"layers {a}-{b - 1} ({b - a})"),
             (compress_devices(lay.devices[0][s]), f"(tp {lay.tp})")]
    offloaded = plan.offload.layers[s] if plan.offload.tier != "none" and s < len(plan.offload.layers) else 0
    if offloaded:
        lines.append((f"{offloaded} layer{'s' if offloaded > 1 else ''}", f"offloaded to {plan.offload.tier}"))
    return lines


def _save_atomic(fig, path: Path, fmt: str) -> None:
    """Save `fig` over `path` atomically."""
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format=fmt)
