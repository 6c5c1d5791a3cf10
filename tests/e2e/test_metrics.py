"""`GET /metrics` of a tp=2 server: what it says equals what happened, promtool accepts it, and a real
Prometheus server started here scrapes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import NAME, Server, free_port

ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts"
"""Test artefacts kept after the run (the dashboard's screenshot); ignored by git."""
REQUESTS = [("The capital of France is", 5), ("def fibonacci(n):", 9), ("Water boils at", 3)]


@pytest.fixture(scope="module")
def served(bundled_dir):
    with Server("--tp", "2", "--max-batch", "4", "--max-seq-len", "512", "--metrics-interval-s", "1") as s:
        tokens = 0
        for prompt, n in REQUESTS:
            res = s.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                             "ignore_eos": True})
            assert res.status_code == 200, res.text
            tokens += res.json()["usage"]["completion_tokens"]
        time.sleep(2.5)  # at least one rank poll after the requests
        yield s, tokens


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(samples: dict, name: str, **labels) -> float:
    hits = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def test_metrics_equal_what_happened(served):
    s, tokens = served
    text = httpx.get(s.url + "/metrics", timeout=60).text
    m = _samples(text)
    assert _value(m, "shardlm_generation_tokens_total", model_name=NAME) == tokens
    assert _value(m, "shardlm_time_to_first_token_seconds_count", model_name=NAME) == len(REQUESTS)
    assert _value(m, "shardlm_e2e_request_latency_seconds_count", model_name=NAME) == len(REQUESTS)
    itl = sum(n - 1 for _, n in REQUESTS)  # one gap between each two tokens of a request
    assert _value(m, "shardlm_inter_token_latency_seconds_count", model_name=NAME) == itl
    assert _value(m, "shardlm_request_finished_total", model_name=NAME, finished_reason="length") == len(REQUESTS)
    assert _value(m, "shardlm_requests_running", model_name=NAME) == 0
    assert _value(m, "shardlm_kv_cache_usage_ratio", model_name=NAME) == 0
    for rank in ("0", "1"):
        weights = _value(m, "shardlm_rank_memory_bytes", rank=rank, kind="weights")
        predicted = _value(m, "shardlm_rank_memory_predicted_bytes", rank=rank, kind="weights")
        assert 0.8 < weights / predicted < 1.25, (rank, weights, predicted)
        assert _value(m, "shardlm_rank_memory_bytes", rank=rank, kind="rss") > weights
        assert _value(m, "shardlm_rank_memory_bytes", rank=rank, kind="kv_cache") > 0
        assert _value(m, "shardlm_rank_memory_capacity_bytes", rank=rank) > weights
    one_way = _value(m, "shardlm_link_bytes_total", src="0", dst="1", op="all_reduce")
    assert one_way > 0 and one_way == _value(m, "shardlm_link_bytes_total", src="1", dst="0", op="all_reduce")
    assert _value(m, "shardlm_stage_step_seconds_count", stage="0") >= sum(n for _, n in REQUESTS) // 2
    assert _value(m, "shardlm_stage_step_seconds_predicted", stage="0") > 0


def test_promtool_accepts_the_exposition(served, tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (scripts/setup.sh installs the Debian package prometheus)")
    s, _ = served
    text = httpx.get(s.url + "/metrics", timeout=60).text
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_prometheus_server_scrapes_it(served, tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (scripts/setup.sh installs the Debian package prometheus)")
    s, tokens = served
    port = free_port()
    (tmp_path / "p.yml").write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: shardlm\n"
                                    f"    static_configs:\n      - targets: ['127.0.0.1:{s.port}']\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'p.yml'}", f"--storage.tsdb.path={tmp_path / 'db'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        got, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline and got is None:
            time.sleep(1)
            try:
                res = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", timeout=5,
                                params={"query": "shardlm_generation_tokens_total"}).json()
            except (httpx.TransportError, ValueError):
                continue
            result = res.get("data", {}).get("result", [])
            got = float(result[0]["value"][1]) if result else None
        assert got == tokens, got
    finally:
        prom.terminate()
        prom.wait(timeout=30)


def test_shardlm_top_shows_the_same_numbers(served):
    s, tokens = served
    res = subprocess.run([sys.executable, "-m", "shardlm", "top", s.url, "--count", "1"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert f"generated {tokens} tokens" in res.stdout, res.stdout
    assert "memory per rank" in res.stdout and "traffic per link" in res.stdout and "time to first token" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "shardlm", "top", f"http://127.0.0.1:{free_port()}", "--count", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is `shardlm serve` running there?" in bad.stderr, bad.stderr


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_dashboard_in_headless_chromium_equals_metrics_and_updates(served, tmp_path):
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs the Debian package chromium)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: run scripts/setup.sh")
    s, tokens = served
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(s.url + "/dashboard", timeout=60_000)
            page.wait_for_function(f"document.getElementById('generated').textContent === '{tokens}'", timeout=30_000)
            m = _samples(httpx.get(s.url + "/metrics", timeout=60).text)
            link = sum(x.value for x in m["shardlm_link_bytes_total"] if (x.labels["src"], x.labels["dst"]) == ("0", "1"))
            shown = page.locator("[data-link='0,1']").inner_text()
            assert abs(float(shown) - link / 2**20) < 0.06, (shown, link)  # every op over the link, in MiB
            ttft = page.locator("[data-count='shardlm_time_to_first_token_seconds']").inner_text()
            assert float(ttft) == _value(m, "shardlm_time_to_first_token_seconds_count", model_name=NAME)
            res = s.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
            assert res.status_code == 200
            page.wait_for_function(f"document.getElementById('generated').textContent === '{tokens + 4}'",
                                   timeout=30_000)  # it updates by itself
            assert page.locator("#error").inner_text() == ""
            shot = ARTIFACTS / "dashboard.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()


def test_ranks_report_while_a_request_decodes_and_its_tokens_do_not_change(served):
    """Polls during decode ride on the steps (each rank sends its counters after a step): the step counts on
    /metrics grow between two scrapes taken while a request runs, and its tokens equal the same request run
    with nobody scraping."""
    s, _ = served
    body = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    assert s.post("/v1/completions", body).status_code == 200
    rate = 32 / (time.monotonic() - t0)  # tokens a second, the prefill included
    # about 5 s of decoding, where two scrapes 1.2 s apart fit with room: a host decoding 25 tok/s at tp 2 asks for
    # about 100 tokens, one decoding 150 for the 400 every host was asked for before (100 were not enough there)
    body["max_tokens"] = int(min(400, max(80, 5 * rate)))
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(res=s.post("/v1/completions", body)))
    worker.start()
    counts, running = [], []
    deadline = time.monotonic() + 60
    while worker.is_alive() and len(counts) < 2 and time.monotonic() < deadline:
        time.sleep(1.2)  # the poller gathers every 1 s
        m = _samples(httpx.get(s.url + "/metrics", timeout=60).text)
        running.append(_value(m, "shardlm_requests_running", model_name=NAME))
        counts.append(_value(m, "shardlm_stage_step_seconds_count", stage="0"))
    worker.join(timeout=120)
    assert len(counts) == 2 and running == [1, 1], (counts, running, body["max_tokens"], "ended before two scrapes")
    assert counts[1] > counts[0], counts
    alone = s.post("/v1/completions", body)
    assert box["res"].json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]


def test_an_unbalanced_plan_is_refused_then_served_with_its_slow_stage_flagged(bundled_dir):
    """25 of 30 layers on stage 0: `serve` refuses the plan before loading anything; with --allow-imbalance it
    serves, and /metrics, `shardlm top` and the dashboard flag stage 0 from measured step times."""
    layout = ["--pp", "2", "--layers", "25,5", "--max-batch", "2", "--max-seq-len", "128"]
    res = subprocess.run([sys.executable, "-m", "shardlm", "serve", *layout, "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "out of balance" in res.stderr and "--allow-imbalance" in res.stderr and "Traceback" not in res.stderr
    with Server(*layout, "--allow-imbalance", "--metrics-interval-s", "1") as s:
        for prompt in ("The capital of France is", "Water boils at"):
            res = s.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 16, "ignore_eos": True})
            assert res.status_code == 200, res.text
        time.sleep(2.5)  # at least one rank poll after the requests
        text = httpx.get(s.url + "/metrics", timeout=60).text
        m = _samples(text)
        assert _value(m, "shardlm_stage_out_of_balance", stage="0") == 1
        assert _value(m, "shardlm_stage_out_of_balance", stage="1") == 0
        busy = [_value(m, "shardlm_stage_busy_seconds", stage=st) for st in ("0", "1")]
        ratio = _value(m, "shardlm_stage_imbalance_ratio")
        assert ratio == pytest.approx(max(busy) / (sum(busy) / 2) - 1) and ratio > _value(m, "shardlm_stage_imbalance_limit")
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                   timeout=60)
            assert check.returncode == 0, check.stdout + check.stderr
        top = subprocess.run([sys.executable, "-m", "shardlm", "top", s.url, "--count", "1"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert top.returncode == 0 and "out of balance" in top.stdout, top.stdout + top.stderr
        _dashboard_flags_stage(s.url, "0")


def _dashboard_flags_stage(url: str, stage: str) -> None:
    """The dashboard, in headless Chromium, flags `stage` (skipped without chromium or playwright)."""
    browser_path = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if browser_path is None or sync_playwright is None:
        return
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url + "/dashboard", timeout=60_000)
            page.wait_for_selector(f"[data-flag='{stage}']", timeout=30_000)
            assert page.locator("[data-flag]").count() == 1
        finally:
            browser.close()


def test_a_server_that_streams_layers_reports_its_prefetch_hit_rate(bundled_dir, tmp_path):
    with Server("--memory-budget", "250MB", "--offload-dir", str(tmp_path), "--max-batch", "2", "--max-seq-len", "128",
                "--metrics-interval-s", "1") as s:
        res = s.post("/v1/completions", {"model": NAME, "prompt": "Water boils at", "max_tokens": 8, "ignore_eos": True})
        assert res.status_code == 200, res.text
        time.sleep(2.5)  # at least one rank poll after the request
        m = _samples(httpx.get(s.url + "/metrics", timeout=60).text)
    hits, waits = (_value(m, f"shardlm_offload_prefetch_{k}_total", rank="0") for k in ("hits", "waits"))
    assert hits + waits >= 8, (hits, waits)  # every step needs each streamed layer once
    assert _value(m, "shardlm_offload_prefetch_hit_ratio", rank="0") == pytest.approx(hits / (hits + waits))
    assert _value(m, "shardlm_offload_read_bytes_total", rank="0") > 0
    assert _value(m, "shardlm_rank_memory_bytes", rank="0", kind="streamed") > 0
