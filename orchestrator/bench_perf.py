"""Where the daemon's CPU goes, sampled with Linux ``perf``: the share of each shared object
(CPython's interpreter, the kernel, libzmq, msgspec...), of each thread (the loop, ZMQ's I/O
thread), and of the kernel's thread switching. /proc says how much CPU a request costs;
this says what for, kernel included, which no Python profiler sees."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Where the kernel's time goes when threads sleep and wake: the switch itself, and the
# run-queue locks released with interrupts re-enabled (a VM pays for both).
SWITCH_SYMBOLS = ("finish_task_switch", "_raw_spin_unlock_irq", "_raw_spin_unlock_irqrestore")
# perf takes ~0.4 s to attach to a running process here: a load started sooner goes
# partly unsampled (measured: 13 samples of ~400 in 0.2 s).
ATTACH_S = 1.0


def available() -> bool:
    return shutil.which("perf") is not None


def parse_report(text: str) -> list[tuple[float, str]]:
    """``perf report --stdio`` rows as (percent, key), largest first; headers and blanks skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, percent, key = line.partition("%")
        try:
            rows.append((float(head), key.strip()))
        except ValueError:
            continue
    return sorted(rows, reverse=True)


def switching_share(symbols: list[tuple[float, str]]) -> float:
    """The percent of samples in the kernel's thread switching (rows of ``--sort sym``)."""
    return sum(pct for pct, sym in symbols if sym.startswith("[k]") and sym.split()[-1].split(".")[0] in SWITCH_SYMBOLS)


def profile(pid: int, load: Callable[[], None]) -> dict[str, list[tuple[float, str]]]:
    """Sample every thread of ``pid`` while ``load`` runs; rows per ``dso``, ``comm`` and ``sym``."""
    with tempfile.TemporaryDirectory(prefix="triptych-perf-") as tmp:
        data = Path(tmp) / "perf.data"
        recorder = subprocess.Popen(["perf", "record", "-q", "-F", "1999", "-p", str(pid), "-o", str(data)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(ATTACH_S)
            load()
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)
        rows = {
            key: parse_report(subprocess.run(
                ["perf", "report", "-i", str(data), "--no-children", "--sort", key, "--stdio", "-g", "none"],
                capture_output=True, text=True, timeout=120, check=True).stdout)
            for key in ("dso", "comm", "sym")
        }
    if not rows["dso"]:
        raise RuntimeError(f"perf recorded no samples of process {pid} "
                           "(not allowed to attach? see perf_event_paranoid)")
    return rows


def print_profile(title: str, rows: dict[str, list[tuple[float, str]]]) -> None:
    print(f"\n{title}")
    for pct, dso in rows["dso"][:6]:
        print(f"  {pct:5.1f} %  {dso}")
    print(f"  {switching_share(rows['sym']):5.1f} %  of it the kernel switching threads ({', '.join(SWITCH_SYMBOLS)})")
    print("  by thread: " + ", ".join(f"{name} {pct:.1f} %" for pct, name in rows["comm"]))
