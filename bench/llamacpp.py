"""llama.cpp in bench/decode.py's rounds: GGUF files of the benchmark's checkpoint and a system that times them.

The peer runs in its own virtual environment (scripts/setup_llamacpp.sh builds llama-cpp-python there for this
CPU) as a subprocess speaking JSON lines (bench/llamacpp_peer.py), so nothing of llama.cpp enters this process.
GGUFs: f32, f16 and q8_0 made once from the float checkpoint with the converter shipped in that package's source
(vendor/llama.cpp/convert_hf_to_gguf.py, run by this interpreter with the vendored gguf-py and sentencepiece from
a folder of its own), cached beside it;
q4_1 is the bundled model's own file (the checkpoint is its dequantization, shardlm.bundled).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from shardlm.paths import home

VERSION = "0.3.36"
ROOT = home() / "tools" / "llamacpp"
PYTHON = ROOT / "venv" / "bin" / "python"
VENDOR = ROOT / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
CONVERT_DEPS = ROOT / "convert-deps"
"""What the converter imports beyond this environment (sentencepiece), installed apart by the setup script."""
PEER = Path(__file__).resolve().parent / "llamacpp_peer.py"
CONVERTED = ("f32", "f16", "q8_0")
REPLY_TIMEOUT_S = 600.0


def available() -> str | None:
    """None when the peer can run here, else why not (with the fix)."""
    if not PYTHON.exists() or not (VENDOR / "convert_hf_to_gguf.py").exists() or not CONVERT_DEPS.exists():
        return f"llama.cpp is not installed under {ROOT}; install it with `bash scripts/setup_llamacpp.sh`"
    return None


def gguf_files(folder: Path, say) -> dict[str, Path]:
    """{type: GGUF path} for the checkpoint in `folder`, converting what is not cached yet (atomically)."""
    from shardlm.bundled import gguf_path

    st = (folder / "model.safetensors").stat()
    cache = ROOT / "gguf" / f"{folder.name}-{st.st_size}-{st.st_mtime_ns}"
    cache.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in CONVERTED:
        out = cache / f"model-{kind}.gguf"
        if not out.exists():
            tmp = cache / f".model-{kind}.gguf.tmp-{os.getpid()}"
            say(f"converting {folder.name} to GGUF {kind} (one time)")
            env = {**os.environ, "PYTHONPATH": f"{VENDOR / 'gguf-py'}{os.pathsep}{CONVERT_DEPS}"}
            res = subprocess.run([sys.executable, str(VENDOR / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                                  kind, "--outfile", str(tmp)], env=env, capture_output=True, text=True)
            if res.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"convert_hf_to_gguf.py --outtype {kind} failed:\n{res.stderr[-2000:]}")
            os.replace(tmp, out)
        files[kind] = out
    files["q4_1"] = gguf_path()
    return files


class Peer:
    """The llama.cpp process: one per benchmark run, holding every GGUF it was asked to load."""

    def __init__(self):
        self.proc = subprocess.Popen([str(PYTHON), str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._reply()

    def _reply(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            err = self.proc.stderr.read()[-2000:]
            raise RuntimeError(f"the llama.cpp peer gave no answer within {REPLY_TIMEOUT_S:.0f} s (exit "
                               f"{self.proc.poll()}):\n{err}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp peer: {reply['error']}")
        return reply

    def ask(self, **req) -> dict:
        """Send one request and wait (bounded) for its answer."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """Ask the process to quit; kill it if it does not within 10 s."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


class LlamaCppSystem:
    """One GGUF in the peer, with the same decode/prefill calls as the benchmark's other systems."""

    def __init__(self, label: str, peer: Peer, path: Path, dtype: str, metrics: tuple[str, ...], threads: int):
        self.label, self.peer, self.path, self.dtype, self.metrics = label, peer, path, dtype, metrics
        self.threads, self.tp = threads, 1
        self.tokens_b1: list[int] | None = None
        self.tokens_b8_row0: list[int] | None = None
        self.file_bytes = path.stat().st_size

    def start(self) -> None:
        """Load the file (n_ctx for 8 rows of prompt + new tokens, or one 512-token prompt)."""
        t0 = time.perf_counter()
        self.peer.ask(op="load", name=self.label, path=str(self.path), threads=self.threads, n_ctx=4096, n_seq=8)
        self.load_s = time.perf_counter() - t0

    def decode(self, prompts: list[list[int]], new: int, pad: int) -> tuple[float, dict]:
        """Tokens/s of greedy decode (rows x (new - 1) tokens over the decode time)."""
        r = self.peer.ask(op="decode", name=self.label, prompts=prompts, new=new)
        if len(prompts) == 1:
            self.tokens_b1 = r["token_ids"][0]
        else:
            self.tokens_b8_row0 = r["token_ids"][0]
        return r["tokens"] / r["decode_s"], {"decode_s": r["decode_s"], "steps": new - 1}

    def prefill(self, prompt: list[int], pad: int) -> tuple[float, dict]:
        """Tokens/s of one forward of the prompt."""
        r = self.peer.ask(op="prefill", name=self.label, prompt=prompt)
        return r["tokens"] / r["prefill_s"], {"prefill_s": r["prefill_s"]}

    def stop(self) -> None:
        """Nothing per system: the peer is closed once, after the run."""
