"""Greedy decode steps launched ahead (runtime/ahead.py) on the CPU, with the graph replays stood in: the rank's
loop (`serve_steps`, as a rank process runs it) launches step n + 1 before it reads step n, feeding rows whose token
is not read yet from the device. Every request must end with the tokens and finish reason it gets from the plain
rank loop, whatever ends it, while sampled rows, chunked prompts and slot handovers force steps that cannot run
ahead in between."""

import pytest

from pipelined_driver import drive
from refs import build
from shardlm.engine.scheduler import Scheduler
from shardlm.engine.text import load_tokenizer
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget
from shardlm.runtime import ahead as ahead_mod
from shardlm.runtime import slot_graphs
from shardlm.runtime.ahead import Launched, RunAhead
from shardlm.runtime.serve_step import SlotRunner
from shardlm.settings import Settings
from test_pipelined_steps import CANCEL_AFTER, CHUNK, MAX_LEN, SLOTS, _requests

WAIT_S = 30.0


@pytest.fixture(scope="module")
def rank(bundled_dir):
    """The bundled model's rank with torch kernels (the CPU stand-in replays the captured step through them)."""
    return build(bundled_dir, kv=KVBudget(SLOTS, MAX_LEN, CHUNK), settings=Settings(kernels="torch"))


def _runner(rank, graphs: bool) -> SlotRunner:
    runner = SlotRunner(rank, ParallelContext())
    assert runner.graphs is None and runner.ahead is None  # a CPU rank: no graphs of its own
    if graphs:
        runner.graphs = slot_graphs.SlotGraphs(rank.module, runner.cache, runner.window)
        runner.ahead = RunAhead(runner)
    return runner


def _drive(runner: SlotRunner, tokenizer, reqs) -> None:
    """The engine's pipelined driver (tests/pipelined_driver.py) against `serve_steps` in a thread; request 2 is
    cancelled once it has CANCEL_AFTER tokens."""
    def cancel() -> None:
        if len(reqs[2].output_ids) >= CANCEL_AFTER:
            reqs[2].cancel()

    sched = Scheduler(SLOTS, MAX_LEN, CHUNK, (0,))
    assert drive(runner, sched, {0: reqs}, tokenizer, cancel, wait_s=WAIT_S), \
        "the rank loop or the requests did not finish"


def test_steps_run_ahead_give_every_request_the_plain_loops_tokens(rank, bundled_dir, on_cpu, monkeypatch):
    """Requests ended by max_tokens, max_seq_len, a stop token, a stop string and cancellation, with sampled rows and
    chunked prompts beside them: the same tokens and endings with steps run ahead as with the plain loop."""
    tokenizer = load_tokenizer(bundled_dir)
    probe = _requests(None, None)
    _drive(_runner(rank, graphs=False), tokenizer, probe)
    stop_token = probe[4].output_ids[5]
    stop_text = tokenizer.decode(probe[5].output_ids[3:5]).strip()[:3]
    plain, run_ahead = _requests(stop_token, stop_text), _requests(stop_token, stop_text)
    _drive(_runner(rank, graphs=False), tokenizer, plain)
    # a stood-in step is done at once; hold it "on the device" 20 ms, so the driver's next step arrives meanwhile
    monkeypatch.setattr(Launched, "done", lambda self: ahead_mod.time.perf_counter() > self.t0 + 0.02)
    runner = _runner(rank, graphs=True)
    _drive(runner, tokenizer, run_ahead)
    for a, b in zip(plain, run_ahead):
        assert b.output_ids == a.output_ids, f"{a.id}: tokens differ when steps run ahead"
        assert b.finish_reason == a.finish_reason
    assert [r.finish_reason for r in plain] == ["length", "length", "cancelled", "length", "stop", "stop", "length"]
    assert runner.ahead.overlapped > 0, "no step was launched while the one before it was unread"
    assert runner.ahead.launches < runner.clock.count, "every step ran ahead: none was sampled or prefilled"
    assert not runner.ahead.unread and not runner.ahead.latest
    _metrics_count_the_steps_run_ahead(bundled_dir, rank, runner)


def _metrics_count_the_steps_run_ahead(folder, rank, runner) -> None:
    """/metrics' run-ahead counters are the rank's own (the ranks' poll carries them)."""
    from refs import plan_for
    from shardlm.runtime.worker import rank_stats
    from shardlm.serve.metrics import rank_families

    plan, _ = plan_for(folder, kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    stats = rank_stats(rank, ParallelContext(), runner)
    fams = {f.name: f for f in rank_families([stats], [rank.spec], plan)
            if f.name.startswith("shardlm_rank_steps_run_ahead")}
    got = {name: [s.value for s in f.samples if s.name.endswith("_total")] for name, f in fams.items()}
    assert got == {"shardlm_rank_steps_run_ahead": [runner.ahead.launches],
                   "shardlm_rank_steps_run_ahead_overlapped": [runner.ahead.overlapped]}


def test_a_capture_that_fails_inside_a_launch_leaves_every_request_its_tokens(rank, bundled_dir, on_cpu,
                                                                             monkeypatch):
    """A graph that cannot be captured while a step is launched ahead (the kept graphs are dropped at the fifth
    launch, so the next launch captures): the rank reads what is unread, runs that step and the rest eagerly, and no
    request's tokens change."""
    tokenizer = load_tokenizer(bundled_dir)
    plain, run_ahead = _requests(None, None), _requests(None, None)
    _drive(_runner(rank, graphs=False), tokenizer, plain)
    stand_in, launch = slot_graphs.SlotGraphs._capture, RunAhead.launch
    state = {"launching": False, "failed": 0, "launches": 0}

    def launching(self, step):
        state["launches"] += 1
        if state["launches"] == 5:
            self.graphs.kept.clear()
        state["launching"] = True
        try:
            return launch(self, step)
        finally:
            state["launching"] = False

    def capture(self, rows, length):
        if state["launching"]:
            state["failed"] += 1
            raise RuntimeError("capture refused by the test")
        return stand_in(self, rows, length)

    monkeypatch.setattr(RunAhead, "launch", launching)
    monkeypatch.setattr(slot_graphs.SlotGraphs, "_capture", capture)
    monkeypatch.setattr(Launched, "done", lambda self: ahead_mod.time.perf_counter() > self.t0 + 0.02)
    runner = _runner(rank, graphs=True)
    _drive(runner, tokenizer, run_ahead)
    assert state["failed"] == 1 and runner.graphs.failed
    assert runner.ahead.launches == 4  # the fifth launch failed; steps ran eagerly from then on
    for a, b in zip(plain, run_ahead):
        assert (b.output_ids, b.finish_reason) == (a.output_ids, a.finish_reason), f"{a.id} changed"
