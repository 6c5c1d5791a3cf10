"""CUDA ranks: parity with the unsharded model, NCCL, int8/int4 on the GPU kernels, host-RAM offload.

Skipped where torch sees no CUDA device (CI). The references are transformers' float32 model on
the CPU: a GPU rank must give the same greedy tokens and logits within 1e-4 x max |logit|.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_model
from refs import assert_logits_close, build, hf_logits_and_tokens, plan_for, shardlm_stage_rank
from shardlm.models.args import read_config
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.launch import run_on_ranks
from shardlm.plan.memory import shard_weights, stage_weight_bytes
from shardlm.plan.plan import KVBudget
from shardlm.quant import int4_codes, int8_codes, pack_int4, pack_int8
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch, attention_mask, generate, positions_for
from shardlm.settings import Settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")


def _prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def cuda_rank(rank: int, world: int, folder: str, prompts, n_new: int, quantization=None, budget=None,
              prefetch=True):
    """On one rank, on GPU rank mod the GPUs: full logits over the batch (rank 0), greedy tokens, stats."""
    import torch.distributed as dist

    device = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    ctx = ParallelContext(rank=rank, world=world, cuda_collectives=dist.get_backend() == "nccl")
    model = build(folder, rank, ctx, device, tp=world, quantization=quantization or "none", memory_budget=budget,
                  prefetch=prefetch)
    args = model.args
    batch = Batch.from_lists(prompts)
    s = batch.tokens.shape[1]
    mask = attention_mask(batch.valid, 0, s, args.sliding_window)
    logits = model(batch.tokens.to(device), positions_for(batch.valid).to(device), mask.to(device)).cpu()
    tokens = generate(model, batch, n_new, SamplingParams(), ())
    stats = model.streamer.stats.as_dict() if model.streamer is not None else None
    return (logits if rank == 0 else None), tokens, {"backend": dist.get_backend(), "comms": ctx.snapshot(),
                                                      "stream": stats, "resident": model.resident_bytes(),
                                                      "streamed": list(model.streamed)}


def _check(folder, prompts, n_new, tp, backend="gloo"):
    ref_logits, ref_tokens = hf_logits_and_tokens(hf_model(folder), prompts, n_new)
    results = run_on_ranks(cuda_rank, tp, str(folder), prompts, n_new, timeout_s=300, backend=backend)
    assert_logits_close(results[0][0], ref_logits, Batch.from_lists(prompts).valid)
    for rank, (_, tokens, _) in enumerate(results):
        assert tokens == ref_tokens, f"rank {rank} tokens differ from transformers"
    return results


@pytest.mark.parametrize("name,tp", [("gqa12x4", 1), ("gqa12x4", 5), ("qwen2", 4), ("llama3rope", 3),
                                     ("biased_mha", 2), ("mistral_window", 2)])
def test_cuda_ranks_match_transformers(random_dirs, name, tp):
    """Ranks sharing one GPU talk over gloo, staging each collective through host memory."""
    folder = random_dirs[name]
    vocab = hf_model(folder).config.vocab_size
    results = _check(folder, _prompts(vocab, [37, 12, 25]), 12, tp)
    assert results[0][2]["backend"] == "gloo"
    if tp > 1:
        assert results[0][2]["comms"]["all_reduce"]["calls"] > 0


def test_nccl_rank_matches_transformers(random_dirs):
    """One rank per GPU on NCCL (world 1 here unless the machine has more GPUs)."""
    folder = random_dirs["gqa12x4"]
    world = min(torch.cuda.device_count(), 4)
    results = _check(folder, _prompts(1001, [20, 9]), 8, world, backend="nccl")
    assert results[0][2]["backend"] == "nccl"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU; needs 2 GPUs")
def test_nccl_tensor_parallel_matches_transformers(random_dirs):
    folder = random_dirs["qwen2"]
    results = _check(folder, _prompts(997, [20, 9]), 8, 2, backend="nccl")
    assert results[0][2]["comms"]["all_reduce"]["calls"] > 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("out,k,start,total", [(96, 200, 0, 200), (200, 96, 0, 96), (64, 80, 40, 160)])
def test_gpu_quantized_matmul_equals_its_dequantized_weight(kind, out, k, start, total):
    """The CUDA kernels compute x @ W_hat^T for the W_hat the codes stand for (same codes as on CPU)."""
    g = torch.Generator().manual_seed(out + k)
    w = torch.randn(out, k, generator=g) * 0.05
    x = torch.randn(5, k, generator=g).to(torch.bfloat16).float()
    if kind == "int8":
        q, scale = int8_codes(w)
        w_hat = q.double() * scale.to(torch.bfloat16).double()[:, None]
        gpu, cpu = pack_int8(q, scale, "cuda"), pack_int8(q, scale)
    else:
        q, scale, zero, left, right = int4_codes(w, start, total)
        sb, zb = scale.to(torch.bfloat16).double(), zero.to(torch.bfloat16).double()
        deq = (q.double().view(out, -1, 32) - 8) * sb[..., None] + zb[..., None]  # (out, groups, 32)
        w_hat = deq.view(out, -1)[:, left:left + k]
        gpu, cpu = pack_int4(q, scale, zero, 32, left, right, "cuda"), pack_int4(q, scale, zero, 32, left, right)
    ref = x.double() @ w_hat.t()
    got = gpu.matmul_t(x.cuda()).double().cpu()
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-2, f"{kind} on CUDA: relative error {err:.2e}"
    cpu_err = (cpu.matmul_t(x).double() - ref).norm() / ref.norm()
    # int4 on CUDA is PyTorch's tinygemm kernel: bf16 weight values and a bf16 output, a few roundings of 2^-9
    # each (2.45e-3 measured on an H200), while the CPU's int4 kernels compute in float32 (~1e-7)
    bound = 5e-3 if kind == "int4" else cpu_err * 2 + 1e-3
    assert err < bound, f"CUDA {err:.2e} vs CPU {cpu_err:.2e}"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_on_gpu_is_as_close_to_float32_as_on_cpu(random_dirs, kind):
    """Same codes on both devices, different kernels: the GPU's logits are as close to the float32
    model's as the CPU's (both run bfloat16 activations, so neither equals the other exactly)."""
    folder = random_dirs["gqa12x4"]
    batch = Batch.from_lists(_prompts(1001, [30, 11]))
    s = batch.tokens.shape[1]
    inputs = (batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, None))
    out = {}
    for device, q in (("cpu", None), ("cpu", kind), ("cuda:0", kind)):
        model = build(folder, device=device, settings=Settings(kernels="torch"), quantization=q or "none")
        with torch.no_grad():
            out[device, q] = model(*(t.to(device) for t in inputs)).cpu()
    ref, valid = out["cpu", None], batch.valid
    scale = ref[valid].abs().max()

    def error(x):
        return ((x - ref)[valid].abs().max() / scale).item(), (x.argmax(-1) == ref.argmax(-1))[valid].float().mean().item()

    (cpu_err, cpu_top1), (gpu_err, gpu_top1) = error(out["cpu", kind]), error(out["cuda:0", kind])
    assert gpu_err <= 1.5 * cpu_err + 1e-3, f"{kind}: GPU error {gpu_err:.3g} vs CPU {cpu_err:.3g} (x max |logit|)"
    assert gpu_top1 >= cpu_top1 - 0.05, f"{kind}: GPU top-1 agreement {gpu_top1:.3f} vs CPU {cpu_top1:.3f}"


def _budget_streaming_layers(folder, quantization) -> int:
    """A GPU budget that streams every layer with prefetch (two buffers) and all but one without."""
    family, args = args_for_config(read_config(folder))
    w = shard_weights(args, family.tp_plan, 1, 0, "float32", quantization or "none")
    fixed = stage_weight_bytes(w, 0, True, True) + args.n_layers * w.layer_fixed  # norms, biases stay resident
    return fixed + 2 * w.layer_streamed + w.layer_streamed // 2


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_layers_streamed_from_host_memory_give_the_same_tokens(random_dirs, prefetch, quantization):
    folder = random_dirs["gqa12x4"]
    prompts = _prompts(1001, [37, 12, 25])
    (_, full, _), = run_on_ranks(cuda_rank, 1, str(folder), prompts, 12, quantization, timeout_s=300)
    budget = _budget_streaming_layers(folder, quantization)
    (_, tokens, stats), = run_on_ranks(cuda_rank, 1, str(folder), prompts, 12, quantization, budget, prefetch,
                                       timeout_s=300)
    assert tokens == full
    assert len(stats["streamed"]) == (3 if prefetch else 2), stats["streamed"]
    assert stats["resident"] <= budget + 4096, (stats["resident"], budget)  # + rotary and GQA-map buffers
    st = stats["stream"]
    uses = len(stats["streamed"]) * (1 + 1 + 11)  # the logits pass, the prefill, 11 decode steps
    assert st["prefetch_hits"] + st["prefetch_waits"] == uses
    assert st["reads"] == uses + (1 if prefetch else 0)  # prefetch queues the next step's first layer
    if not prefetch:
        assert st["prefetch_hits"] == 0  # every copy ran on the compute stream, in its way


def test_engine_runs_cuda_ranks_end_to_end(random_dirs):
    """LocalEngine with --device cuda: the rank processes, their GPU memory report, tokens."""
    from shardlm.engine import LocalEngine

    folder = random_dirs["qwen2"]
    prompts = _prompts(997, [15, 7])
    _, ref_tokens = hf_logits_and_tokens(hf_model(folder), prompts, 10)
    for tp in (1, 2):
        plan, source = plan_for(folder, tp=tp, device="cuda")
        with LocalEngine(plan, source, timeout_s=300) as engine:
            result = engine.generate(prompts, 10, SamplingParams(), ignore_eos=True)
            ready = engine.ready
        assert result.token_ids == ref_tokens, f"tp {tp}"
        assert all(r["device"].startswith("cuda") and r["peak_gpu_bytes"] > 0 for r in ready)


@pytest.mark.parametrize("name", ["gqa12x4", "mistral_window"])
def test_engine_decode_replayed_as_cuda_graphs_gives_the_eager_tokens(random_dirs, name):
    """The engine's decode steps on one GPU replay CUDA graphs (runtime/slot_graphs.py): rows of different lengths,
    each batch's tokens equal to the eager engine's (SHARDLM_CUDA_GRAPHS=0) and to transformers'."""
    from shardlm.engine import LocalEngine

    folder = random_dirs[name]
    prompts = _prompts(read_config(folder)["vocab_size"], [19, 4, 11, 7, 30])  # mistral_window has 700 tokens
    _, ref_tokens = hf_logits_and_tokens(hf_model(folder), prompts, 24)
    got = {}
    for graphs in (True, False):
        plan, source = plan_for(folder, device="cuda")
        with LocalEngine(plan, source, settings=Settings.from_env(cuda_graphs=graphs), timeout_s=300) as engine:
            got[graphs] = engine.generate(prompts, 24, SamplingParams(), ignore_eos=True).token_ids
    assert got[True] == got[False] == ref_tokens


@torch.inference_mode()
def test_a_serving_step_launched_ahead_does_not_wait_for_the_gpu(random_dirs):
    """runtime/ahead.py: launching a greedy decode step queues its work behind what the GPU is doing, without
    waiting for it (a copy from pageable memory or a read back would); its tokens equal a plain step's."""
    from shardlm.runtime.serve_step import SlotRunner
    from shardlm.runtime.work import Decode, Prefill, SlotStart, Step

    folder = random_dirs["gqa12x4"]
    rank = build(folder, device="cuda:0", kv=KVBudget(4, 128, 64))
    greedy, prompts = SamplingParams(), _prompts(read_config(folder)["vocab_size"], [9, 5, 7])
    runs = {}
    for ahead in (False, True):
        runner = SlotRunner(rank, ParallelContext())
        assert runner.graphs is not None and runner.ahead is not None
        first = runner.run(Step(0, tuple(SlotStart(s, 0) for s in range(3)),
                                tuple(Prefill(s, tuple(p), 0, True, greedy) for s, p in enumerate(prompts)), ()))
        tokens = {s: [got.token] for s, got in first.slots.items()}
        for i in range(1, 6):
            step = Step(i, (), (), tuple(Decode(s, tokens[s][-1], len(prompts[s]) + i - 1, greedy) for s in range(3)))
            if not ahead:
                result = runner.run(step)
            else:
                runner.ahead.read(runner.ahead.launch(step))  # the first launch captures its graph (synchronizes)
                torch.cuda._sleep(200_000_000)  # keeps the GPU busy for a while
                busy = torch.cuda.Event()
                busy.record()
                launched = runner.ahead.launch(step)  # the same step again: same inputs, same cache writes
                assert not busy.query(), "launch waited for the GPU's earlier work"
                result = runner.ahead.read(launched)
            for s, got in result.slots.items():
                tokens[s].append(got.token)
        runs[ahead] = tokens
    assert runs[True] == runs[False]


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Llama-3.2-1B's widths (hidden 2048, MLP 8192, vocab 128256) in 2 random bfloat16 layers: products wide
    enough that cuBLAS picks its kernels, and so a row's rounding, by the rows a product holds."""
    from shardlm.models.presets import PRESETS
    from shardlm.models.random import write_random_checkpoint

    config = dict(PRESETS["llama-3.2-1b"], num_hidden_layers=2)
    return write_random_checkpoint(config, tmp_path_factory.mktemp("wide") / "m", dtype=torch.bfloat16)


@torch.inference_mode()
def test_a_serving_ranks_8_row_replays_give_the_same_logits_in_every_row_and_run(wide_dir):
    """A serving rank's decode replay of 8 rows holding one prompt, teacher-forced for 96 steps and run twice a step,
    gives bit-equal logits in every row and both runs. Written after bench/gpu_rows.py on an H200 (2026-11-26): with
    the SDPA kernel PyTorch picks (cuDNN's), rows and runs parted from position 71 on; serving ranks now keep
    attention off it (runtime/slot_graphs.py deterministic_attention). Not yet run on a GPU when written."""
    from shardlm.runtime.build import build_rank_model
    from shardlm.runtime.serve_step import SlotRunner, prefill_mask

    plan, source = plan_for(wide_dir, device="cuda", dtype="bfloat16", kv=KVBudget(8, 256, 128))
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        rank = build_rank_model(plan.rank_spec(0), source, ParallelContext(), Settings.from_env({}), "cuda:0")
        runner = SlotRunner(rank, ParallelContext())
        assert runner.graphs is not None and not torch.backends.cuda.cudnn_sdp_enabled()
        prompt = _prompts(read_config(wide_dir)["vocab_size"], [40], seed=7)[0]
        x, pos = torch.tensor([prompt], device="cuda:0"), torch.arange(40, device="cuda:0")[None, :]  # (1, 40) each
        mask = prefill_mask([0], 40, None).to("cuda:0")
        token = {int(rank.module(x, pos, mask, runner.cache.prefill(s, 0, 40), last_only=True)[0, -1].argmax())
                 for s in range(8)}
        assert len(token) == 1
        token = token.pop()
        for step in range(96):
            at = [40 + step] * 8
            first = runner.graphs.logits(list(range(8)), at, [token] * 8)[:, -1]  # (8, vocab)
            again = runner.graphs.logits(list(range(8)), at, [token] * 8)[:, -1]
            assert torch.equal(first, again), f"step {step}: the same 8-row replay gave other logits"
            assert torch.equal(first, first[:1].expand_as(first)), f"step {step}: rows of one prompt differ"
            token = int(first[0].argmax())
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("model,dtype", [("gqa12x4", "float32"), ("gqa12x4", "bfloat16"), ("wide", "bfloat16")])
def test_copies_of_one_prompt_in_one_engine_batch_decode_the_same_tokens(random_dirs, wide_dir, model, dtype):
    """A request's tokens do not depend on the rows beside it: 8 copies of one prompt in one batch of the engine on
    one GPU (its CUDA graphs) decode one token sequence, the one the prompt decodes alone. The prefill budget (128)
    holds 3 of the 40-token prompts, so copies are prefilled in different steps. Written after H200 and H100 runs
    (bench/RESULTS.md, 2026-11-26) in which 8 copies of a Llama-3.2-1B bfloat16 prompt did not (there a product of
    120 rows rounds a row unlike one of 40). These models passed on an H100 also before a prompt's chunks became its
    own and ran in their own pass; bench/gpu_invariance.py is the sharper check. The message says which rows left
    the prompt alone and where."""
    from shardlm.engine import LocalEngine

    folder = wide_dir if model == "wide" else random_dirs[model]
    prompt = _prompts(read_config(folder)["vocab_size"], [40], seed=7)[0]
    plan, source = plan_for(folder, device="cuda", dtype=dtype, kv=KVBudget(8, 256, 128))
    with LocalEngine(plan, source, timeout_s=300) as engine:
        assert engine.scheduler.anchored and engine.ready[0]["prefill_alone"]  # a prompt's chunks are its own
        alone = engine.generate([prompt], 48, SamplingParams(), ignore_eos=True).token_ids[0]
        rows = engine.generate([prompt] * 8, 48, SamplingParams(), ignore_eos=True).token_ids
    first_diff = {j: next((i for i, (a, b) in enumerate(zip(row, alone)) if a != b), None)
                  for j, row in enumerate(rows)}
    assert all(at is None for at in first_diff.values()), f"{dtype}: row -> first token unlike the prompt alone: " \
        f"{first_diff}"


def test_sampling_draws_the_same_tokens_on_cpu_and_gpu(random_dirs):
    """Sampling runs on the host with the rows' generators, so a seed means the same tokens anywhere."""
    folder = random_dirs["gqa12x4"]
    batch = Batch.from_lists(_prompts(1001, [9, 14]))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    out = []
    for device in ("cpu", "cuda:0"):
        model = build(folder, device=device, settings=Settings(kernels="torch"))
        out.append(generate(model, batch, 8, params, ()))
    assert out[0] == out[1]


@pytest.mark.parametrize("name,compile", [("gqa12x4", False), ("mistral_window", False), ("qwen2", False),
                                          ("gqa12x4", True), ("mistral_window", True)])
def test_cuda_graph_decode_gives_the_eager_tokens(random_dirs, name, compile):
    """Graph replays (static shapes: full-length cache under a mask; the replay advancing its own inputs
    where there is no sliding window; compiled or not) give eager decode's tokens, and a second call of
    the same shape reuses the captured graph and its cache. q/k/v and gate/up run joined on the GPU."""
    folder = random_dirs[name]
    model = build(folder, device="cuda:0", settings=Settings.from_env(cuda_compile=compile))
    args = model.args
    assert model.kernels.cuda_graphs and model.graphs is not None and model.kernels.compiled == compile
    assert model.kernels.joined_layers == args.n_layers
    batch = Batch.from_lists(_prompts(args.vocab_size, [21, 6, 13]))
    graphs, model.graphs = model.graphs, None
    eager = generate(model, batch, 20, SamplingParams(), ())
    assert not graphs.kept
    model.graphs = graphs
    first = generate(model, batch, 20, SamplingParams(), ())
    second = generate(model, batch, 20, SamplingParams(), ())
    assert first == eager and second == eager
    (decoder,) = graphs.kept.values()
    assert decoder.graph is not None and not decoder.failed


@pytest.mark.parametrize("tp,counts,m", [(1, (2, 1), 2), (2, (1, 2), 3)])
def test_pipeline_stages_on_cuda_match_transformers(random_dirs, tp, counts, m):
    """Stages on one GPU (gloo; hidden states and tokens staged through host memory), with micro-batches."""
    folder = random_dirs["gqa12x4"]
    prompts = _prompts(1001, [17, 5, 11])
    ref_logits, ref_tokens = hf_logits_and_tokens(hf_model(folder), prompts, 10)
    results = run_on_ranks(shardlm_stage_rank, tp * len(counts), str(folder), prompts, 10, tp, list(counts), m,
                           SamplingParams(), "cuda", timeout_s=300)
    logits = next(r[0] for r in results if r[0] is not None)
    assert_logits_close(logits, ref_logits, Batch.from_lists(prompts).valid)
    assert results[0][1] == ref_tokens


def test_metrics_report_gpu_memory_kinds_of_cuda_ranks(random_dirs):
    """/metrics' memory families for CUDA ranks: allocated and reserved GPU bytes, at least the weights."""
    from shardlm.engine import LocalEngine
    from shardlm.serve.metrics import rank_families

    folder = random_dirs["qwen2"]
    plan, source = plan_for(folder, tp=2, device="cuda")
    with LocalEngine(plan, source, timeout_s=300) as engine:
        engine.generate(_prompts(997, [9, 5]), 4, SamplingParams(), ignore_eos=True)
        stats = engine.rank_stats()
    specs = [plan.rank_spec(r) for r in range(plan.world)]
    memory = next(f for f in rank_families(stats, specs, plan) if f.name == "shardlm_rank_memory_bytes")
    got = {(s.labels["rank"], s.labels["kind"]): s.value for s in memory.samples}
    for rank in ("0", "1"):
        assert got[(rank, "gpu_allocated")] >= got[(rank, "weights")] > 0, got
        assert got[(rank, "gpu_reserved")] >= got[(rank, "gpu_allocated")], got
