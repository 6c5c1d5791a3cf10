"""Planner: byte counts, cost formulas, layer balance, search decisions and validation."""

import pytest

from shardlm.hardware import parse_devices
from shardlm.models.inventory import tensor_inventory
from shardlm.models.presets import preset_config
from shardlm.models.registry import args_for_config
from shardlm.plan import memory as mem
from shardlm.plan.balance import assign_layers
from shardlm.plan.cost import pipeline_step_s, ring_all_reduce_s
from shardlm.plan.make import PlanError, load_model, make_plan
from shardlm.plan.plan import KVBudget
from shardlm.plan.search import Request
from shardlm.plan.validate import violations


def _req(model, devices, batch=1, seq=4096, **kw):
    ref, fam, args = load_model(model)
    return Request(ref, args, fam.tp_plan, parse_devices(devices), devices, kv=KVBudget(batch, seq, min(seq, 2048)), **kw)


@pytest.mark.parametrize("name", ["smollm2-135m", "debug", "qwen2.5-72b", "mixtral-8x7b"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_shard_weights_add_up_to_model_plus_replicas(name, tp):
    fam, args = args_for_config(preset_config(name))
    total = sum(mem.tensor_bytes(t, t.shape, "float32", "none") for t in tensor_inventory(args) if t.layer == 0)
    shards = [mem.shard_weights(args, fam.tp_plan, tp, r, "float32", "none") for r in range(tp)]
    norms = 2 * args.dim * 4  # two RMSNorm weights per layer, replicated on every rank
    from shardlm.parallel.split import HeadSplit
    replicas = HeadSplit(args.n_heads, args.n_kv_heads, tp).kv_replicas()
    kv_head = 2 * args.head_dim * args.dim * 4 + (2 * args.head_dim * 4 if args.attention_bias else 0)
    router = args.n_experts * args.dim * 4
    assert sum(s.layer for s in shards) == total + (tp - 1) * (norms + router) + replicas * kv_head


def test_quantized_bytes():
    fam, args = args_for_config(preset_config("llama-3.1-8b"))
    w16 = mem.shard_weights(args, fam.tp_plan, 1, 0, "bfloat16", "none").layer
    w8 = mem.shard_weights(args, fam.tp_plan, 1, 0, "bfloat16", "int8").layer
    w4 = mem.shard_weights(args, fam.tp_plan, 1, 0, "bfloat16", "int4").layer
    # the runtime's formats (shardlm.quant): int8 + a bfloat16 scale per row; int4 + a bfloat16 scale
    # and zero per 32 columns, i.e. 0.625 bytes per weight against 2
    assert 0.49 < w8 / w16 < 0.51 and 0.31 < w4 / w16 < 0.32


def test_ring_all_reduce_formula():
    assert ring_all_reduce_s(1, 1e6, 1e-6, 1e9) == 0
    assert ring_all_reduce_s(4, 4e6, 1e-6, 1e9) == pytest.approx(6e-6 + 1.5 * 4e6 / 1e9)


def test_pipeline_step_and_bubble():
    assert pipeline_step_s([1.0, 1.0], 0.0, 1, decode=True) == (2.0, 0.5)
    step, bubble = pipeline_step_s([1.0, 1.0], 0.0, 4, decode=False)
    assert step == 5.0 and bubble == pytest.approx(1 / 5)
    assert pipeline_step_s([1.0, 1.0], 0.0, 4, decode=True) == (4.0, 0.0)


def test_assign_layers_balances_and_respects_caps():
    assert assign_layers(30, [1.0, 2.0], [0, 0], [100, 100]) == [20, 10]
    assert assign_layers(30, [1.0, 1.0], [0, 0], [12, 100]) == [12, 18]
    assert assign_layers(30, [1.0, 1.0], [0, 0], [10, 10]) is None


def test_70b_on_8xh100_is_tp8_bf16():
    best = make_plan(_req("llama-3.1-70b", "8xH100-80GB", batch=8)).ranked[0].plan
    assert (best.layout.tp, best.layout.pp, best.quantization) == (8, 1, "none")


def test_405b_on_two_nodes_keeps_tp_inside_a_node():
    best = make_plan(_req("llama-3.1-405b", "2x8xH100-80GB", batch=8)).ranked[0].plan
    assert (best.layout.tp, best.layout.pp, best.quantization) == (8, 2, "none")
    for stage in best.layout.devices[0]:
        assert len({a.split(":")[0] for a in stage}) == 1


def test_8b_on_24gb_with_long_batch_quantizes_rather_than_offloads():
    best = make_plan(_req("llama-3.1-8b", "1xRTX4090-24GB", batch=8, seq=8192)).ranked[0].plan
    assert best.quantization == "int8" and best.offload.tier == "none"


def test_heterogeneous_devices_get_layers_by_capacity_and_speed():
    best = make_plan(_req("llama-3.1-70b", "2xRTX4090-24GB,1xA6000-48GB", batch=4, seq=8192)).ranked[0].plan
    assert best.layout.pp == 3 and best.predictions.performance.imbalance < 0.15
    assert not violations(best)


def test_pinned_tp_that_does_not_divide_heads():
    best = make_plan(_req("debug", "5xcpu-1GB", tp=5, seq=64)).ranked[0].plan
    assert best.layout.tp == 5
    weights = [r.weights for r in best.predictions.memory]
    assert max(weights) > min(weights)  # 12 heads over 5 ranks: the imbalance is modelled


def test_fits_nowhere_says_by_how_much_and_what_helps():
    with pytest.raises(PlanError, match=r"fits nowhere .* GiB over .*int4|fits nowhere .*devices of"):
        make_plan(_req("llama-3.1-405b", "1xRTX4090-24GB", quantization="none"))


def test_imbalanced_pinned_layers_fit_but_are_flagged():
    best = make_plan(_req("llama-3.1-8b", "2xH100-80GB", pp=2, layers=(28, 4))).ranked[0].plan
    assert any("out of balance" in v for v in violations(best))


def test_throughput_counts_max_batch_across_replicas():
    res = make_plan(_req("llama-3.1-70b", "8xH100-80GB", batch=8, objective="throughput"))
    best = res.ranked[0].plan
    assert best.predictions.memory[0].kv_cache * best.layout.dp <= \
        max(c.plan.predictions.memory[0].kv_cache * c.plan.layout.tp for c in res.ranked)


def test_more_cpu_ranks_than_cores_is_flagged_in_the_assumptions(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLM_HOME", str(tmp_path))
    (tmp_path / "calibration.json").write_text('{"date": "2026-01-01", "cpu": {"cores": 2}}')
    crowded = make_plan(_req("smollm2-135m", "4xcpu-1GB", seq=512, tp=4)).ranked[0].plan
    assert any("4 ranks on 2 cores" in a for a in crowded.predictions.assumptions), crowded.predictions.assumptions
    fits = make_plan(_req("smollm2-135m", "2xcpu-2GB", seq=512, tp=2)).ranked[0].plan
    assert not any("ranks on 2 cores" in a for a in fits.predictions.assumptions)


def test_ranks_beyond_the_cores_run_in_waves():
    """3 lock-step ranks on 2 cores take two waves per step: 4/3 of an even split's time; 4 ranks
    fill two waves exactly, so they cost what an even split does."""
    from shardlm.hardware import Cluster, Device, Node, cpu_spec
    from shardlm.plan.predict import _rate

    spec = cpu_spec(2**30, {"cpu": {"cores": 2, "bandwidth": 30e9, "flops": 1e11, "layer_overhead_s": 1e-4}})
    dev = Device(0, 0, spec)
    cluster = Cluster((Node("local", (dev,), shared_memory_bus=True, cores=2),))
    rates = {n: _rate(dev, n, cluster) for n in (1, 2, 3, 4)}
    assert rates[2].bandwidth == pytest.approx(15e9) and rates[2].layer_overhead_s == pytest.approx(1e-4)
    # per-rank time for 1/n of the weights, relative to one rank doing all of them
    step = {n: (1 / n) / rates[n].bandwidth * rates[1].bandwidth for n in rates}
    assert step[2] == pytest.approx(1.0) and step[4] == pytest.approx(1.0)
    assert step[3] == pytest.approx(4 / 3)
    assert rates[3].layer_overhead_s == pytest.approx(2e-4) and rates[4].layer_overhead_s == pytest.approx(2e-4)


def test_gpu_layouts_without_cuda_graphs_pay_the_eager_layer_cost():
    """One GPU: the engine replays decode steps as CUDA graphs (runtime/slot_graphs.py), so the plan pays the replay
    cost per layer (65 us, the engine measured on an H100); tp 2 issues kernels from the host and pays the eager
    one (~0.75 ms per layer on an H100 machine's host)."""
    from shardlm.hardware import CUDA_EAGER_LAYER_OVERHEAD_S, CUDA_LAYER_OVERHEAD_S

    one = make_plan(_req("llama-3.2-1b", "1xH100-80GB", dtype="bfloat16", quantization="none")).ranked[0].plan
    two = make_plan(_req("llama-3.2-1b", "2xH100-80GB", dtype="bfloat16", quantization="none", tp=2)).ranked[0].plan
    step1, step2 = (p.predictions.performance.decode_latency_s for p in (one, two))
    assert 16 * CUDA_LAYER_OVERHEAD_S < step1 < 16 * CUDA_LAYER_OVERHEAD_S + 2e-3
    assert step2 > 16 * CUDA_EAGER_LAYER_OVERHEAD_S
    assert any("CUDA graphs" in a for a in one.predictions.assumptions)
    assert any("issued by the host" in a for a in two.predictions.assumptions)


def test_host_ram_offload_streams_at_the_devices_pcie_rate():
    """GPU ranks stream offloaded layers at their own host link: 55 GB/s measured on an H100."""
    from shardlm.plan.predict import offload_bandwidth
    from shardlm.hardware import Device, CATALOG

    assert offload_bandwidth("cpu", Device(0, 0, CATALOG["H100-80GB"])) == 55e9
    assert offload_bandwidth("cpu", Device(0, 0, CATALOG["RTX4090-24GB"])) == 25e9
    assert offload_bandwidth("disk", Device(0, 0, CATALOG["H100-80GB"])) == 2e9
    assert offload_bandwidth("none", Device(0, 0, CATALOG["H100-80GB"])) is None
