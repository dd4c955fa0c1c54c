"""The host's recorded state over a run, as the simulator and `kvplane calibrate live` read it.

A live run on a shared machine samples the host's run queue (`procs_running` of /proc/stat:
threads running or ready to run, on all cores) every quarter second (tests/live
live_workloads.py `HostSampler`), stamped with the wall clock the events use, and keeps the
samples with the run (`meta.host_samples`: `[time, run queue, load average]` each). The state
at a moment is the mean of the samples within `window` seconds either side of it (the
nearest sample where none is that close): the same average when the calibration bins the
recorded hops of one run (sim/live_calibration.py) and when a twin draws a hop of another run
at its simulated time (sim/engine.py `Simulation.hop`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["HostTimeline", "state_bin"]


class HostTimeline:
    """Run-queue samples over time, averaged over a window around any moment."""

    def __init__(self, times: Sequence[float], run_queue: Sequence[float], window: float) -> None:
        if len(times) != len(run_queue) or not times:
            raise ValueError("host samples: as many times as values, one at least")
        pairs = sorted(zip(times, run_queue, strict=True))
        self.times = [t for t, _ in pairs]
        self.values = [float(v) for _, v in pairs]
        self._sums = [0.0, *accumulate(self.values)]
        self.window = window

    @classmethod
    def from_samples(cls, samples: Sequence[Sequence[float]], window: float,
                     shift: float = 0.0) -> HostTimeline:
        """From recorded samples (`[time, run queue, ...]`), times moved by `shift` seconds."""
        if any(len(s) < 2 for s in samples):
            raise ValueError("host samples: each one is [time, run queue, ...]")
        return cls([s[0] + shift for s in samples], [s[1] for s in samples], window)

    def at(self, t: float) -> float:
        """The mean run queue of the samples within `window` of `t`, else the nearest one."""
        lo = bisect_left(self.times, t - self.window)
        hi = bisect_right(self.times, t + self.window)
        if hi > lo:
            return (self._sums[hi] - self._sums[lo]) / (hi - lo)
        i = min(bisect_left(self.times, t), len(self.times) - 1)
        if i > 0 and t - self.times[i - 1] < self.times[i] - t:
            i -= 1
        return self.values[i]


def state_bin(edges: Sequence[float], value: float) -> int:
    """The bin of `value` among bins cut at ascending `edges` (0 .. len(edges)); a value on an
    edge belongs to the bin above it."""
    return bisect_right(edges, value)
