"""How many threads torch's CPU work uses when other processes share the machine.

torch's CPU operations and the C++ kernels split their work over OpenMP threads, one per core, and OpenMP threads
spin at each barrier waiting for the others. When another process keeps a core busy, the thread waiting for that
core holds up every barrier for a scheduler time slice: a decode then runs several times slower than on one thread.
`ThreadGovernor` watches the machine between forwards and uses one thread fewer per core that other processes keep
busy, and the cores again once they are free. A fixed `--threads N` turns it off.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

INTERVAL_S = 0.25  # how often the load is read: a window this long, between two forwards
PROBE_S = 0.05  # the first reading, when the governor starts (/proc/stat counts in 10 ms ticks)
SPARE = 0.3  # other processes' busy cores below this many count as none (daemons, this process's own helpers)


@dataclass(frozen=True)
class CpuTimes:
    at: float  # monotonic seconds
    busy: float  # seconds of CPU time the whole machine spent busy (all cores)
    own: float  # of those, this process's


def read_times(stat: str = "/proc/stat") -> CpuTimes | None:
    """The machine's busy CPU seconds and this process's own; None where /proc/stat cannot be read (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    times = os.times()
    return CpuTimes(time.monotonic(), (sum(fields[:8]) - idle) / ticks, times.user + times.system)


def others_busy(before: CpuTimes, after: CpuTimes) -> float:
    """Cores that other processes kept busy between two readings, on average."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall


def threads_for(others: float, most: int, cores: int) -> int:
    """One thread per core that other processes leave free (of `cores` in all), at most `most`, at least one."""
    return max(1, min(most, cores - math.ceil(others - SPARE)))


class ThreadGovernor:
    """Sets torch's thread count between forwards (`poll`) from the load of the other processes on the machine:
    fewer threads as soon as they take cores, the full count again once a second window in a row finds them free."""

    def __init__(self, most: int | None = None, interval_s: float = INTERVAL_S, probe_s: float = PROBE_S) -> None:
        self.most = most or torch.get_num_threads()
        self.cores = os.cpu_count() or self.most  # the machine's, as /proc/stat counts them
        self.interval_s = interval_s
        self.threads = torch.get_num_threads()
        self._last = read_times()
        self._raise_seen = False
        if self.active and probe_s > 0:  # a first reading before any parallel work: the thread pool starts right
            time.sleep(probe_s)
            self._raise_seen = True
            self.poll(force=True)

    @property
    def active(self) -> bool:
        return self._last is not None and self.most > 1

    def poll(self, force: bool = False) -> int:
        """Read the load if a window has passed and set the thread count; returns the count in use."""
        if not self.active or (time.monotonic() - self._last.at < self.interval_s and not force):
            return self.threads
        now = read_times()
        want = threads_for(others_busy(self._last, now), self.most, self.cores)
        self._last = now
        if want > self.threads and not self._raise_seen:  # more threads: only after two windows agree
            self._raise_seen = True
            return self.threads
        self._raise_seen = False
        if want != self.threads:
            log.info("other processes' load: %d CPU thread(s) instead of %d", want, self.threads)
            torch.set_num_threads(want)
            self.threads = want
        return self.threads
