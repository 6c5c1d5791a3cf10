"""llama.cpp as a benchmark peer: a process that loads GGUF files and times decode and prefill on token ids.

Run by bench/llamacpp.py with the Python of the llama.cpp tools environment (scripts/setup_llamacpp.sh), never by
shardlm itself. It reads one JSON request per line on stdin and answers one JSON line on stdout (logs go to stderr):

    {"op": "load", "name": "q8_0", "path": "...gguf", "threads": 2, "n_ctx": 4096, "n_seq": 8}
    {"op": "decode", "name": "q8_0", "prompts": [[ids], ...], "new": 128}
    {"op": "prefill", "name": "q8_0", "prompt": [ids]}
    {"op": "quit"}

The timing follows shardlm's definitions (bench/decode.py): decode time runs from right after the prompt's forward
to the last new token, (new - 1) forwards plus greedy sampling, and counts rows x (new - 1) tokens; every row of a
batch is its own sequence in one llama_batch per step. Prefill is one forward of the prompt with the logits of its
last position only. The KV cache is cleared before every call.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp as L
import numpy as np

QUIET = None
"""The log callback that silences llama.cpp (a reference kept for as long as the process runs)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Model:
    """One GGUF file and a context sized for `n_seq` sequences in `n_ctx` positions."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int):
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = getattr(L, "LLAMA_FLASH_ATTN_TYPE_ENABLED", 1)
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = True
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = True  # one cache shared by the sequences, as shardlm's batch shares its slots
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = cp.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, n_seq)

    def clear(self) -> None:
        """Empty the KV cache (every sequence)."""
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def _run(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(items)} tokens")

    def _argmax(self, index: int) -> int:
        ptr = L.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(self.n_vocab,))))

    def decode(self, prompts: list[list[int]], new: int) -> dict:
        """Greedy decode of `new` tokens per row; every prompt has the same length."""
        self.clear()
        n = len(prompts[0])
        items = [(t, p, s, p == n - 1) for s, row in enumerate(prompts) for p, t in enumerate(row)]
        if len(items) > self.n_batch:
            raise ValueError(f"{len(items)} prompt tokens exceed the batch of {self.n_batch}")
        self._run(items)
        t0 = time.perf_counter()
        last = [self._argmax(s * n + n - 1) for s in range(len(prompts))]
        out = [[t] for t in last]
        for step in range(1, new):
            self._run([(out[s][-1], n + step - 1, s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
        took = time.perf_counter() - t0
        return {"decode_s": took, "tokens": len(prompts) * (new - 1), "token_ids": out}

    def prefill(self, prompt: list[int]) -> dict:
        """One forward of the whole prompt, logits of its last position only."""
        self.clear()
        items = [(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)]
        t0 = time.perf_counter()
        self._run(items)
        self._argmax(len(items) - 1)
        return {"prefill_s": time.perf_counter() - t0, "tokens": len(prompt)}


def main() -> None:
    L.llama_backend_init()
    global QUIET
    QUIET = L.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp calls it later
    L.llama_log_set(QUIET, ctypes.c_void_p(0))
    models: dict[str, Model] = {}
    print(json.dumps({"ready": True, "version": L.__version__,
                      "system": L.llama_print_system_info().decode().strip()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                break
            if req["op"] == "load":
                t0 = time.perf_counter()
                models[req["name"]] = Model(req["path"], req["threads"], req["n_ctx"], req["n_seq"])
                reply = {"load_s": time.perf_counter() - t0}
            elif req["op"] == "decode":
                reply = models[req["name"]].decode(req["prompts"], req["new"])
            elif req["op"] == "prefill":
                reply = models[req["name"]].prefill(req["prompt"])
            else:
                raise ValueError(f"unknown op {req['op']!r}")
        except Exception as e:  # noqa: BLE001 - the benchmark reports it with the request
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
