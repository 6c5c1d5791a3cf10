"""Timing a captured decode step of bench/gpu.py's in-process system on the GPU: its replay, and its kernels."""

from __future__ import annotations

import torch


@torch.inference_mode()
def replay_ms(dec, n: int = 50) -> float:
    """GPU time of one decode step: n replays of a captured GraphDecoder `dec` back to back, timed with events
    (its cache slots from 0 on are overwritten; the next generate call starts from an empty cache anyway)."""
    dec.slot.fill_(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        dec.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


@torch.inference_mode()
def kernel_profile(dec, n: int = 20, top: int = 25) -> dict:
    """Where a decode step's GPU time goes: torch.profiler's CUDA kernels over n replays of a captured
    GraphDecoder `dec` ("replay"; empty where the profiler does not see inside graphs) and over n uncaptured calls
    of the same step ("step": the kernels one by one, launch gaps excluded), each kernel's microseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for label, run in (("replay", dec.graph.replay), ("step", dec._forward)):
        dec.slot.fill_(0)  # slots 0..n-1 of its cache, as in replay_ms
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                run()
            torch.cuda.synchronize()
        kernels = [{"name": e.key[:120], "calls_per_step": e.count / n,
                    "us_per_step": getattr(e, "self_device_time_total", 0) / n}
                   for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        kernels.sort(key=lambda k: -k["us_per_step"])
        out[label] = {"total_us_per_step": sum(k["us_per_step"] for k in kernels),
                      "kernels_per_step": sum(k["calls_per_step"] for k in kernels), "top": kernels[:top]}
    return out
