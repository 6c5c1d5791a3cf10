"""The benchmark scripts that lean on the engine's insides still run: short versions of their loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_engine_load_reports_the_steps_it_timed():
    """`bench/engine_load.py` (the serving load in-process, its ranks' seconds by step kind) on 4 short requests:
    every round completes and the step table counts decode and prefill steps with their seconds."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_load.py"), "--concurrency", "2", "--requests",
                          "4", "--input-len", "8", "--output-len", "4", "--rounds", "1"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("round 1: c2, 4 requests in ") and "output tok/s" in lines[0], out.stdout
    assert " steps, " in lines[1] and "rank seconds" in lines[1] and float(lines[1].split(", ")[1].split()[0]) > 0
    kinds = " ".join(lines[2:])
    assert "decode 2 rows" in kinds or "decode 1 rows" in kinds, out.stdout
    assert "prefill 8 tokens" in kinds or "prefill 16 tokens" in kinds, out.stdout


@pytest.mark.parametrize("extra", [[], ["--format", "bfloat16"], ["--format", "int8"],
                                   ["--format", "int8", "--sums", "exact"], ["--format", "int4"]])
def test_decode_products_prints_one_line_per_row_count_and_place(extra):
    """`bench/decode_products.py` at 1 and 2 rows, 1 round, float32, bfloat16, int8 and int4: a table row for memory
    and caches at each."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_products.py"), "--rows", "1,2", "--rounds", "1",
                          *extra], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (extra[1] if extra else "float32") in out.stdout.splitlines()[0], out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 4 and all(float(r.split("|")[4]) > 0 for r in rows), out.stdout


def test_few_rows_prints_both_kernels_with_the_same_bits():
    """`bench/few_rows.py` at 3 and 20 rows, 2 rounds: a table row for each, both kernels timed, the same bits."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "few_rows.py"), "--rows", "3,20", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 3 |") or line.startswith("| 20 |")]
    assert len(rows) == 2 and all(float(r[2]) > 0 and float(r[3]) > 0 and r[5].strip() == "yes" for r in rows), \
        out.stdout


def test_prefill_products_times_every_product_and_weight_kind():
    """`bench/prefill_products.py` at 20 rows, 1 round of 1 call: a table row for each product, weight kind and kind of
    sums, and torch's F.linear for each product, each with a time and a ratio to float32's."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_products.py"), "--rows", "20", "--rounds", "1",
                          "--calls", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("kernels: native (") and " 20 rows, " in out.stdout, out.stdout
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "ms a call" not in line]
    assert len(rows) == 18 and all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows), out.stdout
    assert sum("torch F.linear" in r[3] for r in rows) == 3, out.stdout


def test_decode_runs_compares_run_lengths_on_the_same_tokens():
    """`bench/decode_runs.py` with runs of 1 and 4, int4, 1 round of 8 tokens: a table row with both run lengths and
    their ratio (the script itself exits non-zero when a run length gives other tokens)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_runs.py"), "--runs", "1,4", "--formats", "int4",
                          "--rounds", "1", "--new-tokens", "8", "--no-write"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| int4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 4 and float(cells[1].split()[0]) > 0 and cells[3].endswith("x"), out.stdout


def _int4_round(script: str) -> tuple[list[str], str]:
    """`bench/<script> --formats int4 --rounds 1 --no-write`: the cells of its int4 row, and its output."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--formats", "int4", "--rounds", "1",
                          "--no-write"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| int4 |"))
    return [c.strip() for c in row.strip("|").split("|")], out.stdout


def test_floor_share_reports_a_share_per_round():
    """`bench/floor_share.py` for int4, 1 round: the weight bytes, the step time and a share of the floor."""
    cells, out = _int4_round("floor_share.py")
    assert float(cells[1]) > 50 and float(cells[2]) > 0 and cells[5].endswith("%"), out


def test_step_phases_reports_each_phase_of_a_round():
    """`bench/step_phases.py` for int4, 1 round: the step time, the time outside the blocks, each phase's work (the
    products with their weights' GB/s) and the two threads' waits."""
    cells, out = _int4_round("step_phases.py")
    assert len(cells) == 11 and float(cells[2]) > float(cells[3]) > 0, out
    for product in (cells[4], cells[7], cells[8], cells[9]):
        ms, rate = product.split(" (")
        assert float(ms) > 0 and rate.endswith("GB/s)") and float(rate.split()[0]) > 0, out
    assert cells[10].endswith(f"({os.cpu_count()} threads)"), out


def test_stream_ceiling_reports_every_loop_beside_the_read_rate(tmp_path):
    """`bench/stream_ceiling.py`, 1 round over 16 MB: the `sum()` figures and a rate and share for each of the four
    loops (compiled into the home given, so a run leaves nothing elsewhere)."""
    if subprocess.run(["g++", "--version"], capture_output=True).returncode != 0:
        pytest.skip("g++ is not installed: the script compiles its loops")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "stream_ceiling.py"), "--rounds", "1", "--mb", "16",
                          "--repeats", "1", "--no-write"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "SHARDLM_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 6 and all(c.endswith("%)") and float(c.split()[0]) > 0 for c in cells[2:]), row
    assert list((tmp_path / "tools" / "stream_ceiling").iterdir()), "the loops' binary should sit under the home"


def test_greedy_runs_compares_compiled_and_python_runs():
    """`bench/greedy_runs.py` for int4 at 1 row, 1 round: a table row with both timings and their ratio (the script
    itself exits non-zero when the two give other tokens)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "greedy_runs.py"), "--formats", "int4", "--batches", "1",
                          "--rounds", "1", "--no-write"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| int4 | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2].split()[0]) > 0 and float(cells[3].split()[0]) > 0 and float(cells[4]) > 0, out.stdout


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_products_vs_commit_loads_a_tree_build_beside_this_one(fmt):
    """`bench/products_vs_commit.py`'s parts (the whole script needs a git worktree of another commit): a tree's
    kernels built by a child and loaded here, a tree's quant.py loaded as its own module (int4 packs by it), timing a
    pass of one layer's products, and the same products as this process's own build."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import products_vs_commit as pvc
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import torch

    from shardlm.kernels.build import extension
    from shardlm.quant import quantize_int4
    from shardlm.settings import Settings

    loaded = pvc.built_kernels(ROOT)
    own = extension(Settings.from_env().kernel_dir)
    assert loaded.__file__ == own.__file__  # this tree's build (another tree's has a name of its own)
    quant = pvc.tree_quant(ROOT)
    layers = [pvc.layer_weights(torch.Generator().manual_seed(1), fmt, [quant, quant])]
    xs = {k: torch.randn(2, k) for k in (576, 1536)}
    assert pvc.one_pass(loaded, layers, xs, fmt, build=1) > 0
    k, (w, _) = layers[0][-1]
    if fmt == "int4":  # the module loaded from the tree packs as this process's shardlm.quant does
        f = torch.randn(40, 96)
        ref, got = quantize_int4(f), quant.quantize_int4(f)
        assert torch.equal(got.packed, ref.packed) and torch.equal(got.scales_zeros, ref.scales_zeros)
        assert torch.equal(loaded.gemm_int4(xs[k], *w.kernel_args(), False, False),
                           own.gemm_int4(xs[k], *w.kernel_args(), False, False))
    elif fmt == "int8":
        assert torch.equal(loaded.gemv_int8(xs[k], w.q, w.scale), own.gemv_int8(xs[k], w.q, w.scale))
    else:
        assert torch.equal(loaded.gemv(xs[k], w), own.gemv(xs[k], w))


def test_attention_vs_commit_rows_time_both_builds_and_sdpa():
    """`bench/attention_vs_commit.py`'s table row (the whole script needs a git worktree of another commit), with this
    tree's build in both places: timings for both and SDPA, no difference between the builds, and the
    output near float64 SDPA."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import attention_vs_commit as avc
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import torch

    own = avc.built_kernels(ROOT)
    for dtype, near in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        row = avc.compare({"this tree": own, "again": own}, dtype, 40, 3)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 8 and all(float(c.split()[0]) > 0 for c in cells[1:6]), row
        assert float(cells[6]) == 0 and float(cells[7]) < near, row


def test_prefill_vs_transformers_prints_a_row_a_format():
    """`bench/prefill_vs_transformers.py` with a short prompt and two rounds: a row per format, both rates > 0."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_vs_transformers.py"), "--formats", "bf16,f32",
                          "--tokens", "16", "--rounds", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for fmt in ("bf16", "f32"):
        cells = [c.strip() for c in next(line for line in out.stdout.splitlines()
                                         if line.startswith(f"| {fmt} |")).strip("|").split("|")]
        assert float(cells[1].split()[0]) > 0 and float(cells[2].split()[0]) > 0, out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_vs_transformers.py"), "--formats", "int3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--formats takes f32, bf16 (got int3)" in bad.stderr


def test_serve_fuzz_finds_nothing_in_a_short_run():
    """`bench/serve_fuzz.py` with 80 random bodies (bad and valid) against one tp 1 server: every reply a 200 or an
    OpenAI error JSON, the server healthy after, SIGTERM exit 0 (the script exits 1 on any finding). Valid bodies
    ask for at most 4 tokens: the same bodies get the same statuses as uncapped (uncapped 119 s, a cap of 40 58 s
    and of 16 48 s on 2026-11-29; caps of 16 and 4 52.6 and 40.0 s on 2026-12-07, a slower host); what the fuzz
    looks for is in the bodies, and long generations are the soak's."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_fuzz.py"), "--requests", "80", "--seed", "3",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "80 requests, seed 3: " in out.stdout, out.stdout
    assert "HTTP 200 x" in out.stdout and "HTTP 400 x" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("0 findings"), out.stdout


def test_prefix_sharing_times_both_ways_and_finds_the_same_tokens():
    """`bench/prefix_sharing.py` with short prompts: a row per n, fewer prompt tokens computed with sharing on for
    n > 1, and the same tokens either way (the script exits 1 otherwise)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "prefix_sharing.py"), "--choices", "1,3",
                          "--prompt-len", "40", "--max-tokens", "3", "--rounds", "1", "--no-write"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| 1 |")
            or line.startswith("| 3 |")}
    assert rows["1"].rstrip().endswith("| 40 / 40 |") and rows["3"].rstrip().endswith("| 44 / 120 |"), out.stdout
    assert "the same for every request" in out.stdout, out.stdout


def test_n_choices_times_each_n_and_counts_the_reused_prompt_tokens():
    """`bench/n_choices.py` against shardlm alone with short prompts: a row per n, and n - 1 copies of the prompt but
    its last two tokens reused for n > 1 (the script exits non-zero on a reply that is not all n choices)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "n_choices.py"), "--no-vllm", "--choices", "1,3",
                          "--prompt-len", "40", "--max-tokens", "3", "--rounds", "1", "--no-write"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| shardlm |")]
    assert len(rows) == 2 and rows[0].rstrip().endswith("| 0 of 40 |") and rows[1].rstrip().endswith("| 76 of 120 |"), \
        out.stdout


def test_startup_vs_commit_times_a_fresh_command_and_tables_the_ratio(bundled_dir):
    """`bench/startup_vs_commit.py`'s parts (the whole script needs a git worktree of another commit): one fresh
    `generate` of this tree, timed, and the table row it makes against itself."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import startup_vs_commit as svc
    finally:
        sys.path.remove(str(ROOT / "bench"))
    got = svc.measure({"this tree": ROOT}, {"bundled": bundled_dir}, [2], 1)
    assert len(got[("this tree", "bundled", 2)]) == 1 and got[("this tree", "bundled", 2)][0] > 0
    got[("abc1234", "bundled", 2)] = got[("this tree", "bundled", 2)]
    rows = svc.table(got, "abc1234", ["bundled"], [2])
    assert rows[0] == "| model | tp | this tree, s | abc1234, s | ratio |" and rows[2].endswith("| 1.00x |"), rows
