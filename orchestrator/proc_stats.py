"""What the OS says of a process: its CPU time, wake-ups and resident memory, from /proc.

Read from the OS, not measured inside the process, so a benchmark's figures include every
thread (ZMQ's I/O thread too) and the kernel's share, and still compare on a noisy machine.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _user_system(stat: Path) -> tuple[float, float]:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of ``pid``, the exited ones included."""
    return sum(_user_system(Path(f"/proc/{pid}/stat")))


def main_thread_user_seconds(pid: int) -> float:
    """User CPU of ``pid``'s main thread: the daemon's own work (its Python, codecs, ZMQ's
    API), without the kernel's part: system calls and waking other threads, which a VM
    makes dear."""
    return _user_system(Path(f"/proc/{pid}/task/{pid}/stat"))[0]


def context_switches(pid: int) -> int:
    """Voluntary switches of every live thread of ``pid``: each is a sleep, so each is a wake-up."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class RssPeak(threading.Thread):
    """The most memory ``pid`` held, sampled every 10 ms until ``stop`` is set."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, rss_mib(self.pid))
