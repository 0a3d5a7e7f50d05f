"""The host-cost timer (benchmarks/kernels/host_cost.py) synchronises often enough that CUDA's launch
queue never fills inside the timer (a full queue makes the CPU wait for the GPU, which the timer would
then count as CPU cost: docs/kernels/dispatch-table.md). CPU only: a counting stand-in for the synchronisation."""

from __future__ import annotations

from benchmarks.kernels import host_cost


def _timed(calls: int, reps: int):
    events = []
    host_cost.per_call_us(lambda: events.append("call"), calls, reps=reps,
                          sync=lambda: events.append("sync"))
    return events


def test_no_more_than_sync_every_calls_between_synchronisations():
    # CUDA queues ~1,000 launches; the slowest kernel per launch timed (MiMo 1 x 4096, ~26 µs of GPU
    # per ~10 µs of CPU) leaves ~150 of 250 calls queued when the next synchronisation comes.
    assert host_cost.SYNC_EVERY <= 256
    events = _timed(calls=1000, reps=3)
    run = longest = 0
    for e in events:
        run = run + 1 if e == "call" else 0
        longest = max(longest, run)
    assert longest <= host_cost.SYNC_EVERY
    assert events.count("call") == 1 + 3 * 1000
    assert events[-1] == "sync"  # the queued work is drained outside the timer


def test_cpu_timing_runs_one_block():
    """``sync=None`` (host_cost_cpu.py, CPU tensors): nothing to drain, one block of calls."""
    events = []
    host_cost.per_call_us(lambda: events.append("call"), 1000, reps=1, sync=None)
    assert events == ["call"] * 1001
