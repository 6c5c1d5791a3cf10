"""`shardlm serve` against real clients: the openai package (sync, async, streaming), curl, plain HTTP.

One tp=1 server serves most tests (module fixture); the layouts tp 2, tp 3 and tp 2 x pp 2 each get their
own server for parity. The oracle is transformers' unsharded model: a request's tokens must equal its
greedy continuation whatever else is in the batch, whenever it arrives.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from shardlm.engine.text import load_tokenizer
from serving import KEY, NAME, Server, sse_events

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at", "My favourite book is", "import numpy as np\n",
           "The quick brown fox", "In 1969, the first man on the moon", "A haiku about autumn:",
           "SELECT name FROM users WHERE", "The largest planet in the solar system is", "Dear Sir or Madam,",
           "To make a cup of tea, first", "The Pythagorean theorem states that", "Photosynthesis is"]
LENGTHS = [4 + (7 * i) % 17 for i in range(len(PROMPTS))]  # 4..20 tokens, all different neighbours


@pytest.fixture(scope="module")
def server(bundled_dir):
    with Server("--max-batch", "16", "--max-seq-len", "256", "--prefill-chunk", "32") as s:
        yield s


@pytest.fixture(scope="module")
def tok(bundled_dir):
    return load_tokenizer(bundled_dir)


@pytest.fixture(scope="module")
def hf_greedy(bundled_dir, tok):
    """text -> transformers' greedy continuation of `n` tokens, decoded (no EOS stop)."""
    from conftest import hf_model

    model, memo = hf_model(bundled_dir), {}

    def run(text: str, n: int) -> str:
        if (text, n) not in memo:
            ids = torch.tensor([tok(text)["input_ids"]])
            with torch.no_grad():
                out = model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=0, eos_token_id=None)
            memo[text, n] = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        return memo[text, n]

    return run


def _complete(server: Server, prompt, n: int, **extra) -> dict:
    res = server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                          "ignore_eos": True, **extra})
    assert res.status_code == 200, res.text
    return res.json()


def _stream_text(client, prompt: str, n: int, delay: float = 0.0, **extra) -> str:
    time.sleep(delay)
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


@pytest.fixture(scope="module")
def alone(server):
    """Each prompt's greedy text with nothing else running (one request at a time)."""
    return [_complete(server, p, n)["choices"][0]["text"] for p, n in zip(PROMPTS, LENGTHS)]


def test_models_health_version_stats(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/version").json()["version"]
    st = server.stats()
    assert st["ready"] and st["slots"] == 16 and st["running"] == 0 and st["free_slots"] == 16


def test_sync_async_and_stream_equal_transformers(server, hf_greedy):
    import openai

    client = server.client()
    prompts = PROMPTS[:3]
    want = [hf_greedy(p, 12) for p in prompts]
    sync = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}) for p in prompts]
    assert [r.choices[0].text for r in sync] == want
    assert all(r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length" for r in sync)

    async def both():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        rs = await asyncio.gather(*[aclient.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                                               extra_body={"ignore_eos": True}) for p in prompts])
        await aclient.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(both()) == want
    assert [_stream_text(client, p, 12) for p in prompts] == want
    batched = _complete(server, prompts, 12)  # a list prompt: one call, three choices in one batch
    assert [c["text"] for c in sorted(batched["choices"], key=lambda c: c["index"])] == want


def test_chat_equals_transformers_on_the_chat_template(server, tok, bundled_dir, hf_greedy):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    templated = AutoTokenizer.from_pretrained(bundled_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                               tokenize=False)
    want = hf_greedy(templated, 10)
    client = server.client()
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10


def test_sixteen_concurrent_streams_equal_each_alone(server, alone):
    client, got = server.client(), [None] * len(PROMPTS)

    def one(i):
        got[i] = _stream_text(client, PROMPTS[i], LENGTHS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == alone
    assert server.stats()["finished"].get("length", 0) >= 2 * len(PROMPTS)


def test_staggered_arrivals_equal_each_alone(server, alone):
    client, got = server.client(), {}
    picks = [1, 5, 9, 13, 3, 7]

    def one(k, i):
        got[i] = _stream_text(client, PROMPTS[i], LENGTHS[i], delay=0.2 * k)

    threads = [threading.Thread(target=one, args=(k, i)) for k, i in enumerate(picks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got.get(i) for i in picks] == [alone[i] for i in picks]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(server):
    body = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    first = _complete(server, "Once upon a time", 16, **body)["choices"][0]["text"]
    client, others = server.client(), []
    threads = [threading.Thread(target=lambda p=p: others.append(_stream_text(client, p, 24))) for p in PROMPTS[:5]]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the seeded request joins a running batch
    again = _complete(server, "Once upon a time", 16, **body)["choices"][0]["text"]
    for t in threads:
        t.join(timeout=300)
    assert again == first and len(others) == 5
    other_seed = _complete(server, "Once upon a time", 16, **{**body, "seed": 99})["choices"][0]["text"]
    assert other_seed != first  # the seed is honoured, not ignored


def _shared_tokens(server: Server) -> float:
    """shardlm_prompt_tokens_shared_total on /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("shardlm_prompt_tokens_shared_total{"))


def test_n_choices_compute_their_prompt_once_and_each_writes_what_its_seed_writes_alone(server):
    """n = 4 choices of one prompt (the scheduler's prefix sharing: the copies take its keys and values from the first
    choice's slot, /metrics counts the tokens): choice j's text is a lone request's with seed + j."""
    prompt = "The history of the Roman Empire begins with the founding of the city, which the legends date to 753 BC"
    before = _shared_tokens(server)
    body = {"temperature": 0.9, "seed": 77}
    res = server.post("/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                          "n": 4, **body})
    assert res.status_code == 200, res.text
    got = sorted(res.json()["choices"], key=lambda c: c["index"])
    alone = [_complete(server, prompt, 12, **{**body, "seed": 77 + j})["choices"][0]["text"] for j in range(4)]
    assert [c["text"] for c in got] == alone and len(set(alone)) > 1
    assert _shared_tokens(server) - before >= 3 * 16  # three copies of a prompt of more than 18 tokens


def test_cancelled_stream_frees_its_slot(server):
    before = server.stats()["finished"].get("cancelled", 0)
    body = {"model": NAME, "prompt": "Count to one thousand:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as res:
        seen = 0
        for line in res.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    deadline, st = time.monotonic() + 20, {}
    while time.monotonic() < deadline:
        st = server.stats()
        if st["running"] == 0 and st["finished"].get("cancelled", 0) > before:
            break
        time.sleep(0.1)
    assert st["running"] == 0 and st["free_slots"] == st["slots"], st
    assert st["finished"].get("cancelled", 0) == before + 1, st


def test_curl_streams_server_sent_events(server, alone):
    body = '{"model": "%s", "prompt": "%s", "max_tokens": %d, "temperature": 0, "ignore_eos": true, "stream": true}' % (
        NAME, PROMPTS[0], LENGTHS[0])
    res = subprocess.run(["curl", "-sN", "--max-time", "120", "-H", f"Authorization: Bearer {KEY}", "-H",
                          "Content-Type: application/json", "-d", body, server.url + "/v1/completions"],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr
    events = sse_events(res.stdout.splitlines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == alone[0]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"temperature": -1}, "temperature", ["temperature", "greater than or equal to 0"]),
    ({"top_p": 1.5}, "top_p", ["top_p", "less than or equal to 1"]),
    ({"max_tokens": -3}, "max_tokens", ["max_tokens"]),
    ({"n": 99}, "n", ["n", "16"]),
    ({"prompt": list(range(300))}, "prompt", ["300", "256"]),
    ({"prompt": [10**7]}, "prompt", ["49151"]),
    ({"frequency_penalty": 0.5}, "frequency_penalty", ["not supported"]),
    ({"stop": 5}, "stop", ["stop"]),
    ({"prompt": "caf\ud800"}, "prompt", ["not Unicode text", "U+D800", "character 3"]),
    ({"prompt": ["Hi", "x\udfff"]}, "prompt.1", ["U+DFFF"]),
    ({"stop": ["a", "\ud83d"]}, "stop.1", ["U+D83D"]),
    ({"model": "smol\ud800"}, "model", ["U+D800"]),
])
def test_bad_parameters_are_400_naming_the_parameter(server, body, param, words):
    res = server.post("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 4, **body})
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400, err
    assert all(w in err["message"] for w in words), err["message"]


def test_chat_text_that_is_not_unicode_is_400_and_the_server_serves_on(server):
    for content, param in (("x\ud800", "messages.0.content"),
                           ([{"type": "text", "text": "a\udc00b"}], "messages.0.content")):
        res = server.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": content}]})
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
        assert "lone surrogate" in res.json()["error"]["message"]
    res = server.post("/v1/completions", {"model": NAME, "prompt": "caf\u00e9 \ud83d\ude00", "max_tokens": 2})
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 2, res.text  # a whole pair is text


def test_auth_model_and_route_errors(server):
    for key in (None, "wrong"):
        res = server.post("/v1/completions", {"model": NAME, "prompt": "Hi"}, key=key)
        assert res.status_code == 401 and "--api-key" in res.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    res = server.post("/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert res.status_code == 404 and NAME in res.json()["error"]["message"]
    res = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error"
    res = httpx.post(server.url + "/v1/completions", content=b'{"model": "smol", "prompt": "\xc3"}', timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # not UTF-8
    assert res.status_code == 400 and "encoded as UTF-8" in res.json()["error"]["message"], res.text
    res = server.post("/v1/nothing", {})
    assert res.status_code == 404 and "/v1/completions" in res.json()["error"]["message"], res.text
    res = httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert res.status_code == 405 and res.json()["error"]["type"] == "invalid_request_error", res.text


def test_loading_is_503_a_full_queue_429_and_sigterm_finishes_requests_in_flight(bundled_dir):
    s = Server("--max-batch", "1", "--max-queue", "1", "--max-seq-len", "256").start()
    try:
        codes = _health_until_ready(s)
        assert 503 in codes and codes[-1] == 200, codes
        body = {"model": NAME, "prompt": "Tell me a story.", "max_tokens": 40, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=120, headers=headers) as http:
            with http.stream("POST", s.url + "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # it holds the one slot
                waiting = threading.Thread(target=lambda: http.post(s.url + "/v1/completions", json={**body, "stream": False}))
                waiting.start()
                _until(lambda: s.stats()["waiting"] == 1)
                res = http.post(s.url + "/v1/completions", json=body)
                assert res.status_code == 429 and res.json()["error"]["type"] == "rate_limit_error", res.text
                s.proc.send_signal(15)  # SIGTERM with two requests in flight: both finish, then exit 0
                rest = sse_events(list(lines))
            waiting.join(timeout=120)
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
        assert s.stop() == 0, s.tail()
    finally:
        s.stop()


def _health_until_ready(s: Server, limit_s: float = 300) -> list[int]:
    codes, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline and (not codes or codes[-1] != 200):
        assert s.proc.poll() is None, s.tail()
        try:
            codes.append(httpx.get(s.url + "/health", timeout=2).status_code)
            if codes[-1] == 503:
                res = s.post("/v1/completions", {"model": NAME, "prompt": "Hi"})
                assert res.status_code in (503, 200) and (res.status_code == 200 or "loading" in res.text), res.text
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return codes


def _until(check, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_port_in_use_is_refused_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "shardlm", "serve", "--port", str(port)], capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"port {port} on 127.0.0.1 is in use" in res.stderr and "--port" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and time.monotonic() - t0 < 60


def test_a_decode_run_out_of_range_is_refused():
    res = subprocess.run([sys.executable, "-m", "shardlm", "serve", "--decode-run", "0"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "--decode-run" in res.stderr and "1" in res.stderr, res.stderr


# tp 3 and tp 2 x pp 2 with steps of several decode tokens (--decode-run; pipeline stages run one token a step); tp 1
# with runs of 8, which its rank takes in one compiled call for greedy rows (runtime/greedy_run.py)
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "3", "--decode-run", "4"],
                                    ["--tp", "2", "--pp", "2", "--decode-run", "4"], ["--tp", "1", "--decode-run", "8"]],
                         ids=["tp2", "tp3-run4", "tp2xpp2", "tp1-run8"])
def test_sharded_servers_equal_transformers(bundled_dir, hf_greedy, layout):
    with Server(*layout, "--max-batch", "4", "--max-seq-len", "128") as s:
        client = s.client()
        prompts = PROMPTS[:2]
        want = [hf_greedy(p, 10) for p in prompts]
        got = [None, None]
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _stream_text(client, prompts[i], 10)))
                   for i in range(2)]
        for t in threads:
            t.start()
        sync = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
        for t in threads:
            t.join(timeout=300)
        assert got == want and sync.choices[0].text == want[0]
        if layout == ["--tp", "2"]:
            _killed_rank_is_named(s)


def _killed_rank_is_named(s: Server) -> None:
    """A rank killed mid-stream: the stream ends with a 500 error naming it, /health says why, exit 1."""
    import os
    import signal

    body = {"model": NAME, "prompt": "Count slowly:", "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as res:
        lines = res.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        victim = s.rank_pids()[-1]
        os.kill(victim, signal.SIGKILL)
        events = sse_events(list(lines))
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == 500 and "rank" in errors[0]["error"]["message"], events[-3:]
    assert s.proc.wait(timeout=60) == 1, s.tail()
    assert "rank" in s.tail()


def test_a_template_that_does_not_parse_is_logged_at_start_and_chat_answers_500(bundled_dir, tmp_path):
    """Completions still serve; the log names the template's line when the server is ready."""
    from conftest import bundled_copy

    folder = bundled_copy(bundled_dir, tmp_path / "model", "{{ messages[0] }", weights=True)
    with Server("--model", str(folder), "--max-batch", "2", "--max-seq-len", "128") as s:
        chat = s.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 500 and "does not parse (line 1" in chat.json()["error"]["message"], chat.text
        assert s.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert "chat completions will answer 500: the model's chat template does not parse (line 1" in s.tail()


def test_idle_longer_than_the_collective_timeout(bundled_dir):
    """Ranks wait for work outside any collective: an idle spell past the timeout is not a hang."""
    with Server("--tp", "2", "--max-batch", "2", "--max-seq-len", "128",
                env={"SHARDLM_COLLECTIVE_TIMEOUT_S": "3"}) as s:
        first = _complete(s, "The capital of France is", 6)["choices"][0]["text"]
        time.sleep(6)  # twice the timeout
        assert _complete(s, "The capital of France is", 6)["choices"][0]["text"] == first
        assert httpx.get(s.url + "/health").status_code == 200


LL_TASK = """task: shardlm_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def test_lm_eval_log_likelihoods_equal_shardlm_perplexity(server, bundled_dir, tmp_path):
    """lm-evaluation-harness's local-completions client (echo + logprobs) scores a text through the server;
    its log-likelihood of everything after the first word must be the NLL `shardlm perplexity` computes."""
    import json
    import math
    import os
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: run scripts/setup.sh")
    from conftest import PROMPT_TEXT
    from test_cli import run_cli

    first = PROMPT_TEXT.split(" ")[0]
    (tmp_path / "doc.jsonl").write_text(json.dumps({"context": first, "target": PROMPT_TEXT[len(first):]}) + "\n")
    (tmp_path / "text.txt").write_text(PROMPT_TEXT)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "ll.yaml").write_text(LL_TASK.format(data=tmp_path / "doc.jsonl"))
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={NAME},base_url={server.url}/v1/completions,tokenizer={bundled_dir},num_concurrent=1,"
            "max_retries=1,tokenized_requests=True", "--include_path", str(tmp_path / "tasks"), "--tasks", "shardlm_ll",
            "--output_path", str(tmp_path / "out"), "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    # shardlm perplexity runs beside lm_eval, which spends most of its time importing (suite time)
    with ThreadPoolExecutor(1) as pool:
        ppl_run = pool.submit(run_cli, "perplexity", "--text", str(tmp_path / "text.txt"), "--json")
        res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
        ppl = ppl_run.result(timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_shardlm_ll*.jsonl") for line in f.open()]
    assert len(samples) == 1, res.stdout[-2000:]
    loglik = float(samples[0]["resps"][0][0][0])  # [[[loglikelihood, is_greedy]]], logged as strings
    assert ppl.returncode == 0, ppl.stderr
    row = json.loads(ppl.stdout)["results"][0]
    served = math.exp(-loglik / row["tokens"])
    assert abs(served / row["perplexity"] - 1) < 1e-3, (served, row["perplexity"], row["tokens"])
