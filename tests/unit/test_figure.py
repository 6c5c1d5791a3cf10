"""draw_plan: a picture of a plan, written atomically, legible from 4 to 128 ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("matplotlib")

from shardlm.plan.figure import compress_devices, draw_plan, memory_bars  # noqa: E402
from shardlm.parallel.stages import even_stages, stages_from_counts  # noqa: E402
from shardlm.plan.layout import ParallelLayout  # noqa: E402
from shardlm.plan.plan import (KVBudget, ModelRef, Offload, Performance, Plan, Predictions,  # noqa: E402
                               RankMemory)

GIB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_plan(tp: int, pp: int, dp: int, n_layers: int, stage_layers=None, gpus_per_node: int = 8,
              over_rank: int | None = None, offload: Offload = Offload()) -> Plan:
    """A hand-made plan on H100-80GB devices; `over_rank` needs 95 GiB in all (15 GiB over)."""
    stage_layers = stage_layers or even_stages(n_layers, pp)
    flat = [f"{i // gpus_per_node}:{i % gpus_per_node}" for i in range(tp * pp * dp)]
    devices = tuple(tuple(tuple(flat[(r * pp + s) * tp:(r * pp + s + 1) * tp]) for s in range(pp))
                    for r in range(dp))
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, stage_layers=stage_layers, devices=devices)
    memory = []
    for c in layout.coords():
        a, b = stage_layers[c.stage]
        weights = (78 if c.rank == over_rank else 40 * (b - a) / n_layers * pp) * GIB
        memory.append(RankMemory(rank=c.rank, device=c.device, device_name="H100-80GB", weights=int(weights),
                                 kv_cache=12 * GIB, activations=3 * GIB, overhead=2 * GIB, capacity=80 * GIB))
    perf = Performance(prefill_tokens_per_s=40000.0, decode_latency_s=0.0312, decode_tokens_per_s=2050.0,
                       single_stream_tokens_per_s=31.0, stage_times_s=(0.0078,) * pp, bubble=0.1,
                       micro_batches=4)
    return Plan(model=ModelRef("llama-70b", "LlamaForCausalLM", 70_000_000_000, n_layers),
                cluster=f"{tp * pp * dp}xH100-80GB", dtype="bfloat16", quantization="none", layout=layout,
                kv=KVBudget(max_batch=64, max_seq_len=4096, prefill_chunk=512), offload=offload,
                predictions=Predictions(memory=tuple(memory), performance=perf))


def check_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


def test_tp2_pp2_within_capacity(tmp_path):
    out = draw_plan(make_plan(tp=2, pp=2, dp=1, n_layers=80), tmp_path / "plan.png")
    assert out == tmp_path / "plan.png"
    check_png(out)


def test_rank_over_capacity_is_called_out(tmp_path):
    plan = make_plan(tp=2, pp=2, dp=1, n_layers=80, over_rank=1)
    check_png(draw_plan(plan, tmp_path / "plan.png"))
    svg = draw_plan(plan, tmp_path / "plan.svg").read_text()
    assert "over by 15.0 GiB" in svg and svg.count("over by") == 1


def test_128_ranks_show_replica_0_merged(tmp_path):
    plan = make_plan(tp=8, pp=8, dp=2, n_layers=126, stage_layers=even_stages(126, 8))
    bars, note = memory_bars(plan)
    assert len(bars) == 8 and "replica 0 of 2 shown" in note  # one bar per stage: its 8 tp ranks agree
    assert bars[0].label == "ranks 0-7  0:0-0:7 H100-80GB"
    check_png(draw_plan(plan, tmp_path / "big.png"))
    svg = draw_plan(plan, tmp_path / "big.svg").read_text()
    assert "replica 0 of 2 shown" in svg and "stage 7: layers 111-125 (15)" in svg


def test_hidden_replica_over_capacity_is_noted():
    plan = make_plan(tp=8, pp=8, dp=2, n_layers=126, over_rank=100)
    bars, note = memory_bars(plan)
    assert "1 hidden rank over capacity" in note


def test_small_plan_has_one_bar_per_rank():
    bars, note = memory_bars(make_plan(tp=2, pp=2, dp=1, n_layers=80))
    assert [b.label for b in bars] == [f"rank {r}  0:{r} H100-80GB" for r in range(4)] and note == ""


def test_offload_and_uneven_stages_draw(tmp_path):
    plan = make_plan(tp=1, pp=3, dp=1, n_layers=32, stage_layers=stages_from_counts([20, 10, 2]),
                     offload=Offload(tier="cpu", layers=(4, 0, 0)))
    svg = draw_plan(plan, tmp_path / "plan.svg").read_text()
    assert "4 layers offloaded to cpu" in svg and "stage 2: layers 30-31 (2)" in svg


def test_pdf_and_uppercase_suffix(tmp_path):
    assert draw_plan(make_plan(1, 1, 1, 4), tmp_path / "p.pdf").read_bytes().startswith(b"%PDF")
    assert draw_plan(make_plan(1, 1, 1, 4), tmp_path / "P.PNG").read_bytes().startswith(PNG_MAGIC)


def test_bad_suffix_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"\.png, \.svg, \.pdf"):
        draw_plan(make_plan(2, 2, 1, 80), tmp_path / "plan.jpg")
    assert list(tmp_path.iterdir()) == []


def test_plan_without_predictions(tmp_path):
    plan = replace(make_plan(2, 2, 1, 80), predictions=None)
    with pytest.raises(ValueError, match="plan has no predictions; make it with `shardlm plan`"):
        draw_plan(plan, tmp_path / "plan.png")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "plan.png"
    out.write_bytes(b"old")
    from matplotlib.figure import Figure

    def boom(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        draw_plan(make_plan(2, 2, 1, 80), out)
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["plan.png"]


@pytest.mark.parametrize("devices, text", [
    (["0:0", "0:1", "0:2", "0:3"], "0:0-0:3"),
    (["0:6", "0:7", "1:0", "1:1"], "0:6-0:7, 1:0-1:1"),
    (["0:0", "0:2"], "0:0, 0:2"),
    (["a:0", "b:0", "c:0", "d:0"], "a:0, b:0, c:0, ..."),
    (["cpu", "cpu1"], "cpu, cpu1"),
])
def test_compress_devices(devices, text):
    assert compress_devices(devices) == text
