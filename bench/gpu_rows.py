"""Where a decode row's result comes to depend on the rows beside it, or on the run: the module, then the op.

bench/gpu_invariance.py found that 8 copies of one prompt in one engine batch leave the tokens of the prompt decoded
alone (every row at the same token), and differ from each other, while every product and attention call it timed
alone gave row 0 the same bits at 1 and 8 rows (bench/RESULTS.md, 2026-11-26). This probe runs a serving rank's
decode step directly, no scheduler and no driver, teacher-forced so that every row's inputs stay identical:

- slots 0..7 of a SlotCache hold the same prompt, prefilled a pass each (their caches compared bit for bit);
- each step, eager: slot 0 alone (1 row), then slots 0..7 (8 rows) twice, all fed the token the lone row chose, at
  the same position (each pass writes the same slot positions, so every pass starts from the same cache). Every
  module's output is kept (forward hooks): the batch's row 0 against the lone row, rows 1..7 against row 0, and the
  second 8-row pass against the first;
- at the first step where one of the three differs, that step again with every aten op inside the first differing
  module recorded (a dispatch mode), so the op that parts them is named;
- the same steps as the engine's CUDA graph replays (runtime/slot_graphs.py) at 1 and 8 rows, the 8-row replay
  twice: the logits compared the same three ways.

Usage: python bench/gpu_rows.py [--device cuda:0] [--model llama-3.2-1b] [--steps 128] [--sdpa engine] [--out FILE]
(on a CPU it runs the module path with SHARDLM_FUSED's kernels off and skips the graphs: a check of the probe).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

ROWS = 8
PROMPT = 40


def first_tensor(out):
    """The first tensor of a module's output (itself, or the first of a tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


class ModuleOutputs:
    """Forward hooks on every named module: {name: output} of the last pass (later calls of a name get #n)."""

    def __init__(self, model: torch.nn.Module):
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(name or "<model>")) for name, m in model.named_modules()]

    def _hook(self, name: str):
        def hook(_module, _inputs, out):
            t = first_tensor(out)
            if t is not None and t.dim() > 0:
                key, n = name, 1
                while key in self.outputs:
                    n += 1
                    key = f"{name}#{n}"
                self.outputs[key] = t.detach().clone()
        return hook

    def take(self) -> dict[str, torch.Tensor]:
        """The outputs recorded since the last take, in call order."""
        out, self.outputs = self.outputs, {}
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()


class OpRecorder(TorchDispatchMode):
    """Every aten op's first output tensor, with the module it ran in (named by `ModuleStack`)."""

    def __init__(self, where: list[str]):
        super().__init__()
        self.where, self.ops = where, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        t = first_tensor(out)
        if t is not None and t.dim() > 0:
            self.ops.append((self.where[-1] if self.where else "<model>", str(func), t.detach().clone()))
        return out


def module_stack(model: torch.nn.Module, where: list[str]) -> list:
    """Pre- and post-hooks that keep `where` as the stack of the modules running now."""
    def leave(_module, _inputs, _out) -> None:
        where.pop()  # a forward hook's return value would replace the output: return None

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda _m, _i, n=name or "<model>": where.append(n)))
        handles.append(m.register_forward_hook(leave))
    return handles


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors differ in shape or in any value (a NaN counts as differing, as torch.equal has it)."""
    return a.shape != b.shape or not torch.equal(a, b)


def row_report(lone: dict, batch: dict, again: dict) -> dict | None:
    """The first module (in call order) where batch row 0 parts from the lone row, rows 1.. from row 0, or the
    second batch pass from the first; None if none does."""
    found = {}
    for name, out in batch.items():
        if "vs lone" not in found and name in lone and out.shape[0] == ROWS and lone[name].shape[0] == 1 \
                and differs(out[:1], lone[name]):
            found["vs lone"] = name
        if "rows vs row 0" not in found and out.shape[0] == ROWS and differs(out, out[:1].expand_as(out)):
            bad = [j for j in range(1, ROWS) if differs(out[j], out[0])]
            found["rows vs row 0"] = f"{name} (rows {bad})"
        if "run vs run" not in found and name in again and differs(out, again[name]):
            found["run vs run"] = name
    return found or None


def build(folder: Path, device: str):
    """A serving rank of the checkpoint on `device` (module path: no fused CPU kernels, no graphs)."""
    from shardlm.engine.session import plan_run
    from shardlm.parallel.context import ParallelContext
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags
    from shardlm.runtime.build import build_rank_model
    from shardlm.settings import Settings

    dev = "cuda" if device.startswith("cuda") else "cpu"
    dtype = "bfloat16" if dev == "cuda" else "float32"
    plan, source = plan_run(str(folder), RunFlags(device=dev, dtype=dtype), kv=KVBudget(ROWS, 1024, 512))
    settings = Settings.from_env({}, cuda_graphs=False, fused=False)
    return build_rank_model(plan.rank_spec(0), source, ParallelContext(), settings, device, "mmap")


def new_cache(rank, prompt: list[int]):
    """A SlotCache whose slots 0..ROWS-1 each hold `prompt` (a prefill pass each); (cache, first token, equal)."""
    from shardlm.runtime.serve_step import prefill_mask
    from shardlm.runtime.slots import SlotCache

    kv, args, dev = rank.spec.kv, rank.args, rank.device
    cache = SlotCache(rank.layer_ids, kv.max_batch, rank.kv_heads, kv.max_seq_len, args.head_dim, rank.dtype, dev)
    x = torch.tensor([prompt], device=dev)  # (1, s)
    positions = torch.arange(len(prompt), device=dev)[None, :]  # (1, s)
    mask = prefill_mask([0], len(prompt), args.sliding_window).to(dev)
    firsts = [int(rank.module(x, positions, mask, cache.prefill(s, 0, len(prompt)), last_only=True)[0, -1].argmax())
              for s in range(ROWS)]
    equal = all(not differs(t[s], t[0]) for d in (cache.k, cache.v) for t in d.values() for s in range(ROWS))
    equal = equal and len(set(firsts)) == 1
    return cache, firsts[0], equal


def eager_step(rank, cache, rows: int, token: int, position: int) -> torch.Tensor:
    """One eager decode pass of slots 0..rows-1, each fed `token` at `position`: logits (rows, vocab)."""
    from shardlm.runtime.serve_step import decode_mask

    dev = rank.device
    x = torch.full((rows, 1), token, device=dev)  # (rows, 1)
    pos = torch.full((rows, 1), position, device=dev)  # (rows, 1)
    mask = decode_mask([position] * rows, rank.args.sliding_window).to(dev)  # (rows, 1, 1, t)
    return rank.module(x, pos, mask, cache.decode(list(range(rows)), [position] * rows), last_only=True)[:, -1]


@torch.inference_mode()
def eager_probe(rank, prompt: list[int], steps: int, say) -> dict:
    """Teacher-forced eager steps (module docstring): per step the lone row, the batch and the batch again; the
    first step where they part, with the module, and that step's ops inside the module."""
    cache, token, equal = new_cache(rank, prompt)
    hooks = ModuleOutputs(rank.module)
    out = {"prefilled slots equal": equal, "steps": 0, "first": None}
    try:
        for i in range(steps):
            position = len(prompt) + i
            lone = eager_step(rank, cache, 1, token, position)
            lone_mods = hooks.take()
            batch = eager_step(rank, cache, ROWS, token, position)
            batch_mods = hooks.take()
            eager_step(rank, cache, ROWS, token, position)
            found = row_report(lone_mods, batch_mods, hooks.take())
            out["steps"] = i + 1
            if found:
                out["first"] = {"step": i, "position": position, "modules": found,
                                "logits": {"row 0 vs lone": differs(batch[:1], lone),
                                           "argmax lone/row 0": [int(lone[0].argmax()), int(batch[0].argmax())]}}
                say(f"eager: step {i} (position {position}) parts: {found}")
                hooks.close()
                out["ops"] = op_diff(rank, cache, token, position)
                break
            token = int(lone[0].argmax())
    finally:
        hooks.close()
    if out["first"] is None:
        say(f"eager: {out['steps']} steps, row 0 equal to the lone row, rows equal, runs equal")
    return out


def record_ops(rank, cache, rows: int, token: int, position: int) -> list:
    """One eager pass with every aten op's output kept: [(module, op, output)]."""
    where: list[str] = []
    handles = module_stack(rank.module, where)
    try:
        with OpRecorder(where) as rec:
            eager_step(rank, cache, rows, token, position)
    finally:
        for h in handles:
            h.remove()
    return rec.ops


def op_diff(rank, cache, token: int, position: int, context: int = 6) -> dict:
    """The step's aten ops, lone against batch, rows against row 0 and batch against batch: the first op that parts
    each way, with the ops before it (module, op, output shape). Ops are matched in order by name; a batch op with
    no lone op of its name close ahead (the one-row path branches) is skipped."""
    lone = record_ops(rank, cache, 1, token, position)
    batch = record_ops(rank, cache, ROWS, token, position)
    again = record_ops(rank, cache, ROWS, token, position)
    report = {}
    for kind in ("vs lone", "rows vs row 0", "run vs run"):
        at, j = None, 0
        for i, (_, func, t) in enumerate(batch):
            if func.startswith("aten.empty") or t.shape[0] != ROWS or not t.is_floating_point():
                continue
            if kind == "rows vs row 0":
                bad = differs(t, t[:1].expand_as(t))
            elif kind == "run vs run":
                bad = i < len(again) and differs(t, again[i][2])
            else:
                match = next((k for k in range(j, min(j + 12, len(lone))) if lone[k][1] == func
                              and lone[k][2].shape[1:] == t.shape[1:] and lone[k][2].shape[0] == 1), None)
                if match is None:
                    continue
                j, bad = match + 1, differs(t[:1], lone[match][2])
            if bad:
                at = i
                break
        report[kind] = None if at is None else [f"{m}: {f} {tuple(t.shape)}" for m, f, t in
                                               batch[max(0, at - context):at + 1]]
        print(f"  first op that parts, {kind}:", *(report[kind] or ["none"]), sep="\n    ", flush=True)
    return report


@torch.inference_mode()
def graph_probe(rank, prompt: list[int], steps: int, say) -> dict:
    """The same teacher-forced steps as the engine's CUDA graph replays: slot 0 alone, slots 0..7, and again."""
    from shardlm.runtime.slot_graphs import SlotGraphs

    cache, token, _ = new_cache(rank, prompt)
    graphs = SlotGraphs(rank.module, cache, rank.args.sliding_window)
    parts = {"vs lone": None, "rows vs row 0": None, "run vs run": None}
    for i in range(steps):
        position = len(prompt) + i
        lone = graphs.logits([0], [position], [token])[:, -1]  # (1, vocab)
        batch = graphs.logits(list(range(ROWS)), [position] * ROWS, [token] * ROWS)[:, -1]  # (rows, vocab)
        again = graphs.logits(list(range(ROWS)), [position] * ROWS, [token] * ROWS)[:, -1]
        if graphs.failed:
            say("graphs: capture failed")
            return {"error": "capture failed"}
        for kind, bad in (("vs lone", differs(batch[:1], lone)), ("run vs run", differs(batch, again)),
                          ("rows vs row 0", differs(batch, batch[:1].expand_as(batch)))):
            if bad and parts[kind] is None:
                parts[kind] = i
        token = int(lone[0].argmax())
    say(f"graphs: first step where the logits part ({steps} steps): {parts}")
    return {"steps": steps, "first step": parts}


def backend(name: str):
    """A context for the attention kernels `--sdpa` names (see its help)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "engine":
        from shardlm.runtime.slot_graphs import deterministic_attention

        deterministic_attention()  # process-wide, as in a serving rank's process
    names = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([names[name]]) if name in names else contextlib.nullcontext()


def main() -> None:
    """Write a random checkpoint, run the eager probe, then the graph probe (CUDA only); one JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the findings to this JSON file")
    ap.add_argument("--sdpa", default="engine", choices=("engine", "auto", "math", "efficient", "flash", "cudnn"),
                    help="attention kernels: engine, as a serving rank runs it (runtime/slot_graphs.py "
                    "deterministic_attention); auto, the one PyTorch picks; or only this SDPA backend")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager probe")
    a = ap.parse_args()
    from shardlm.models.presets import PRESETS
    from shardlm.models.random import write_random_checkpoint

    def say(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "model": a.model, "steps": a.steps, "sdpa": a.sdpa}
    with tempfile.TemporaryDirectory() as tmp:
        dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
        folder = write_random_checkpoint(PRESETS[a.model], Path(tmp) / "m", dtype=dtype)
        rank = build(folder, a.device)
        vocab = rank.args.vocab_size
        prompt = torch.randint(3, vocab, (PROMPT,), generator=torch.Generator().manual_seed(7)).tolist()
        with backend(a.sdpa):
            result["eager"] = None if a.no_eager else eager_probe(rank, prompt, a.steps, say)
            if a.device.startswith("cuda"):
                result["graphs"] = graph_probe(rank, prompt, a.steps, say)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    say(f"done in {result['seconds']} s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
