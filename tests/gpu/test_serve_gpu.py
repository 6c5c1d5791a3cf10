"""`shardlm serve` on one GPU: its steps pipelined and run ahead (the defaults for GPU ranks, the latter counted in
/metrics), requests arriving staggered and streamed, each request's tokens those of transformers' float32 model run
on that prompt alone.

Skipped where torch sees no CUDA device (CI). The model is a small random Llama with a word-level tokenizer written
here (token i is the word "w<i>"), so a completion's text gives back its token ids.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
import torch

from conftest import hf_model
from serving import KEY, NAME, Server, sse_events

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

LENGTHS = [5, 37, 12, 70, 3, 21, 44, 9]  # prompt tokens; 37, 44 and 70 take several 16-token chunks
NEW = 24


def word_tokenizer(folder, vocab: int) -> None:
    """Write a tokenizer.json whose token i is the word "w<i>" (split on spaces, decoded space-joined)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def served_dir(random_dirs, tmp_path_factory):
    """gqa12x4 (vocab 1001) with the word-level tokenizer beside it."""
    folder = tmp_path_factory.mktemp("served") / "m"
    shutil.copytree(random_dirs["gqa12x4"], folder)
    word_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    return folder


def _ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def _stream(server: Server, prompt: list[int], delay: float, out: dict, i: int) -> None:
    time.sleep(delay)
    body = {"model": NAME, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as res:
        events = sse_events(res.iter_lines())
    out[i] = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def _run_ahead_count(server: Server, wait_s: float = 15.0) -> float:
    """shardlm_rank_steps_run_ahead_total of rank 0 from /metrics, polled until it is above 0 or `wait_s` passes
    (the ranks' counters come with their next poll)."""
    deadline, count = time.monotonic() + wait_s, 0.0
    while time.monotonic() < deadline and count <= 0:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        found = [float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("shardlm_rank_steps_run_ahead_total{")]
        count = found[0] if found else 0.0
        time.sleep(0.25)
    return count


def test_serve_on_a_gpu_gives_each_streamed_request_its_tokens_alone(served_dir):
    """8 streamed requests of different lengths for 4 slots, arriving staggered: each gets transformers' greedy
    tokens for its prompt alone, and the rank ran decode steps ahead (on this small model the GPU may finish a
    step before the driver sends the next, so steps overlapping one another are not asserted)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in LENGTHS]
    model = hf_model(served_dir)
    want = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        want.append(ids[0, len(p):].tolist())
    out: dict[int, str] = {}
    with Server("--model", str(served_dir), "--device", "cuda", "--max-batch", "4", "--max-seq-len", "128",
                "--prefill-chunk", "16", "--metrics-interval-s", "0.5") as server:
        threads = [threading.Thread(target=_stream, args=(server, p, 0.02 * (i % 3), out, i))
                   for i, p in enumerate(prompts)]  # 8 requests for 4 slots: some wait, slots change hands
        for t in threads:
            t.start()
        deadline = time.monotonic() + 180
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"requests still running after 180 s:\n{server.tail()}"
        ahead = _run_ahead_count(server)
        assert server.stop() == 0
    assert ahead > 0, "no decode step ran ahead on the GPU rank (/metrics)"
    got = [_ids(out.get(i, "")) for i in range(len(prompts))]
    wrong = {i: next((j for j, (a, b) in enumerate(zip(g_, w)) if a != b), min(len(g_), len(w)))
             for i, (g_, w) in enumerate(zip(got, want)) if g_ != w}
    assert not wrong, f"request -> first token unlike transformers alone: {wrong}"
