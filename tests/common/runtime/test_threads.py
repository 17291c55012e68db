"""The thread governor: one thread fewer per core other processes keep busy, the cores again once they are free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from blockspec.common.runtime import threads
from blockspec.common.runtime.threads import CpuTimes, ThreadGovernor, others_busy, threads_for


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_for_the_load_of_the_others():
    assert [threads_for(x, 2, 2) for x in (0.0, 0.25, 0.8, 1.0, 1.5, 2.0, 5.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert [threads_for(x, 8, 8) for x in (0.0, 1.0, 2.9, 7.5)] == [8, 7, 5, 1]
    assert threads_for(0.0, 1, 2) == 1
    assert threads_for(1.0, 2, 16) == 2 and threads_for(15.0, 2, 16) == 1  # free cores elsewhere: no need to drop


def test_others_busy_leaves_out_this_process():
    before, after = CpuTimes(10.0, 100.0, 5.0), CpuTimes(11.0, 101.8, 5.9)  # 1.8 cores busy, 0.9 of them ours
    assert others_busy(before, after) == pytest.approx(0.9)
    assert others_busy(after, CpuTimes(12.0, 102.0, 7.0)) == 0.0  # never below zero (tick rounding)


def test_the_governor_drops_at_once_and_rises_after_two_free_windows(monkeypatch, restore_threads):
    readings = iter([CpuTimes(0.0, 0.0, 0.0),  # at construction
                     CpuTimes(1.0, 2.0, 1.0),  # others: 1 core
                     CpuTimes(2.0, 2.5, 1.5),  # free
                     CpuTimes(3.0, 4.0, 3.0),  # free again: back to 2
                     CpuTimes(4.0, 6.0, 4.0)])  # others: 1 core
    monkeypatch.setattr(threads, "read_times", lambda: next(readings))
    torch.set_num_threads(2)
    gov = ThreadGovernor(most=2, interval_s=0.0, probe_s=0)
    gov.cores = 2
    assert [gov.poll() for _ in range(4)] == [1, 1, 2, 1]
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(threads.read_times() is None, reason="no /proc/stat here")
def test_a_busy_process_beside_it_takes_a_thread(restore_threads):
    """The real reading: processes that spin on every core but one leave this process one thread. (The way back up
    needs an otherwise idle machine, which a test suite is not: the readings above check it.)"""
    torch.set_num_threads(2)
    gov = ThreadGovernor(most=2, interval_s=0.3)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(gov.cores - 1)]
    try:
        deadline = time.monotonic() + 10
        while gov.poll() != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gov.threads == 1 == torch.get_num_threads()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
