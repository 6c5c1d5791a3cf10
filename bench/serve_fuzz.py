"""Fuzz `shardlm serve`'s OpenAI endpoints: random bodies, malformed and valid, against one server; a finding is any
5xx, a 422 (FastAPI's own status, where OpenAI's is 400), a 4xx whose body is not OpenAI's error JSON, a stream that
ends without `[DONE]`, a reply with the wrong number of choices, a dropped connection, a server that is down at the
end, or a SIGTERM exit other than 0.

    python bench/serve_fuzz.py [--requests 600] [--seed 0] [--valid-share 0.4] [--tp 1] [--max-tokens N]

Bad bodies draw each field from values of every JSON type, extremes, empty and huge lists, strings with a lone
surrogate (JSON lets "\\ud800" through; it reached the tokenizer and gave a 500 until 2026-11-28) and raw bytes that
are not JSON. Valid bodies mix n up to 16, streaming, logprobs, echo, token-id prompts, batched prompts and stop
strings; `--max-tokens N` caps what a valid body asks for (a larger or unset max_tokens becomes N; the bodies drawn
are the same). Prints the status counts and every finding (first 30); exits 1 on any finding. A short run is in the
suite (tests/e2e/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import KEY, NAME, Server  # noqa: E402

ODD = [None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, -2**63, 1e308, -1e308, 0.5, -0.5, 1e-320, "", "x", "0",
       "NaN", [], [[]], [1, 2], [-1], [10**9], [0.5], ["a", 1], {}, {"a": 1}, "a" * 5000, [1] * 3000,
       [[1, 2], [3]], [[-5]], ["hi", "there"], "caf\ud800", "\x00", ["ok", "\udfff"]]
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "logprobs", "echo", "ignore_eos", "model", "messages", "best_of", "presence_penalty", "logit_bias", "user",
          "suffix", "frequency_penalty", "top_logprobs", "max_completion_tokens", "stop_token_ids"]
RAW = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": NaN}', b'{"prompt":"hi","max_tokens":Infinity}', b"1",
       b'{"model": "' + NAME.encode() + b'", "prompt": "\xc3"}']


def bad_body(r: random.Random, chat: bool) -> dict:
    """A body with up to four fields set to odd values."""
    b: dict = {"model": NAME, "max_tokens": 4}
    b.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    for _ in range(r.randint(1, 4)):
        f = r.choice(FIELDS)
        if f == "messages":
            b[f] = r.choice([[{"role": r.choice(["user", "system", "x", None, 3]), "content": r.choice(ODD)}],
                             [{}], [{"role": "user"}], "hi", [],
                             [{"role": "user", "content": [{"type": "text", "text": r.choice(ODD)}]}]])
        elif f == "stream_options":
            b[f] = r.choice([{"include_usage": r.choice(ODD)}, r.choice(ODD)])
        else:
            b[f] = r.choice(ODD)
    return b


def valid_body(r: random.Random, chat: bool, cap: int | None = None) -> dict:
    """A body the server should serve (or refuse with a 400 when its prompt and max_tokens pass the context);
    `cap`: a larger or unset max_tokens becomes it, after the draws (so the same seed draws the same bodies)."""
    b = _valid_draws(r, chat)
    if cap is not None and (b["max_tokens"] is None or b["max_tokens"] > cap):
        b["max_tokens"] = cap
    return b


def _valid_draws(r: random.Random, chat: bool) -> dict:
    """valid_body's random draws, uncapped."""
    b = {"model": NAME, "max_tokens": r.choice([0, 1, 5, 40, 300, None]), "temperature": r.choice([0, 0.7, 1, 2]),
         "top_p": r.choice([1, 0.5, 0.01]), "top_k": r.choice([-1, 0, 1, 50]), "n": r.randint(1, 16),
         "stream": r.random() < 0.5, "seed": r.choice([None, 0, 42, 2**31])}
    if r.random() < 0.3:
        b["stop"] = r.sample(["\n", "the", ".", "a", "zzz", ""], r.randint(0, 4))
    if b["stream"] and r.random() < 0.5:
        b["stream_options"] = {"include_usage": True}
    if chat:
        b["messages"] = [{"role": r.choice(["system", "user", "assistant"]), "content": "hello " * r.randint(0, 30)}
                         for _ in range(r.randint(1, 4))]
        if r.random() < 0.3:
            b["logprobs"], b["top_logprobs"] = True, r.randint(0, 5)
        return b
    kind = r.random()
    if kind < 0.3:
        b["prompt"] = [r.randint(0, 49151) for _ in range(r.randint(1, 300))]
    elif kind < 0.5:
        b["prompt"] = [[r.randint(0, 49151) for _ in range(r.randint(1, 40))] for _ in range(r.randint(1, 4))]
    elif kind < 0.7:
        b["prompt"] = ["x " * r.randint(0, 100) for _ in range(r.randint(1, 3))]
    else:
        b["prompt"] = "word " * r.randint(0, 400)
    b.update({k: v for k, v in (("logprobs", r.randint(0, 5)), ("echo", True), ("ignore_eos", True))
              if r.random() < 0.3})
    return b


def expected_choices(body: dict) -> int | None:
    """How many choices a 200 reply to a valid `body` holds (None: not checked)."""
    prompt = body.get("prompt", "")
    if "messages" in body:
        return body["n"]
    batch = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return batch * body["n"]


def one_request(http: httpx.Client, url: str, r: random.Random, valid_share: float,
                cap: int | None = None) -> tuple[int, str | None, str]:
    """Send one random request: (status, finding or None, what was sent); `cap` as for valid_body."""
    chat = r.random() < 0.3
    url += "/v1/chat/completions" if chat else "/v1/completions"
    if r.random() < 0.05:
        raw = r.choice(RAW)
        res = http.post(url, content=raw, headers={"content-type": "application/json"})
        return res.status_code, check_reply(res.status_code, res.content, None, None), repr(raw)
    valid = r.random() < valid_share
    body = valid_body(r, chat, cap) if valid else bad_body(r, chat)
    sent = json.dumps(body)  # ASCII escapes: a lone surrogate travels as "\ud800", as JSON allows
    headers = {"content-type": "application/json"}
    if body.get("stream") is True:
        with http.stream("POST", url, content=sent, headers=headers) as res:
            payload = res.read()
    else:
        res = http.post(url, content=sent, headers=headers)
        payload = res.content
    want = expected_choices(body) if valid and not body.get("stream") else None
    return res.status_code, check_reply(res.status_code, payload, body.get("stream") is True, want), sent[:300]


def check_reply(status: int, payload: bytes, stream: bool | None, choices: int | None) -> str | None:
    """What is wrong with a reply, or None."""
    if status >= 500 or status == 422:
        return f"HTTP {status}: {payload[:300]!r}"
    if status >= 400:
        try:
            err = json.loads(payload)["error"]
            assert err["message"] and err["type"] and err["code"] == status
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"HTTP {status} without OpenAI's error JSON: {payload[:300]!r}"
        return None
    if stream and b"data: [DONE]" not in payload:
        return f"a stream without [DONE]: ...{payload[-300:]!r}"
    got = len(json.loads(payload)["choices"]) if choices is not None else None
    return f"{got} choices where {choices} were asked" if got != choices else None


def main() -> None:
    """Run the fuzz and print what it found."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--valid-share", type=float, default=0.4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on a valid body's max_tokens (default none)")
    args = ap.parse_args()
    r = random.Random(args.seed)
    statuses: Counter = Counter()
    findings: list[str] = []
    with Server("--tp", str(args.tp), "--max-seq-len", "512") as server:
        with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
            for i in range(args.requests):
                try:
                    status, finding, sent = one_request(http, server.url, r, args.valid_share, args.max_tokens)
                except httpx.HTTPError as e:
                    findings.append(f"request {i}: {e!r}")
                    break
                statuses[status] += 1
                if finding:
                    findings.append(f"request {i} ({sent}): {finding}")
            if httpx.get(server.url + "/health", timeout=10).status_code != 200:
                findings.append("the server is not healthy after the run")
    if server.returncode != 0:
        findings.append(f"SIGTERM exit status {server.returncode}")
    print(f"{sum(statuses.values())} requests, seed {args.seed}: "
          + ", ".join(f"HTTP {k} x {v}" for k, v in sorted(statuses.items())))
    for f in findings[:30]:
        print("finding:", f)
    print(f"{len(findings)} findings")
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
