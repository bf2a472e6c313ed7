"""What the benchmark reads from /proc about the daemon (CPU time, wake-ups, resident memory), and
what it measures in-process (the cost of one hop between actors)."""

from __future__ import annotations

import os
import resource
import shutil
import threading
import time
from functools import partial

import pytest

from orchestrator import bench, bench_perf
from orchestrator.bench import hop_us
from orchestrator.proc_stats import context_switches, cpu_seconds, main_thread_user_seconds, rss_mib


def test_cpu_time_grows_with_work_and_not_with_sleep() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    busy = cpu_seconds(os.getpid())
    assert busy - before >= 0.1
    time.sleep(0.2)
    assert cpu_seconds(os.getpid()) - busy < 0.1


def spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's user CPU, however busy the machine is."""
    start = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    while resource.getrusage(resource.RUSAGE_THREAD).ru_utime - start < seconds:
        sum(range(10_000))


def test_main_thread_user_time_counts_the_main_thread_only() -> None:
    pid = os.getpid()
    mine0, all0 = main_thread_user_seconds(pid), cpu_seconds(pid)
    spin(0.3)
    mine1, all1 = main_thread_user_seconds(pid), cpu_seconds(pid)
    assert mine1 - mine0 >= 0.2 and all1 - all0 >= 0.2
    other = threading.Thread(target=spin, args=(0.3,))
    other.start()
    other.join()
    assert cpu_seconds(pid) - all1 >= 0.2  # the other thread's work is the process's...
    assert main_thread_user_seconds(pid) - mine1 < 0.05  # ...not the main thread's


def test_every_sleep_of_every_live_thread_counts_as_a_wake_up() -> None:
    slept, finish = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(20):
            time.sleep(0.001)
        slept.set()
        finish.wait(10)

    before = context_switches(os.getpid())
    thread = threading.Thread(target=sleeper)
    thread.start()
    try:
        assert slept.wait(10)
        assert context_switches(os.getpid()) - before >= 20
    finally:
        finish.set()
        thread.join()


def test_resident_memory_is_read_in_mib() -> None:
    assert 10 < rss_mib(os.getpid()) < 24 * 1024


def test_a_hop_between_actors_is_timed_over_the_mail_actually_handled() -> None:
    assert 0.01 < hop_us(hops=20_000) < 100


PERF_SYM_REPORT = """\
# Samples: 10K of event 'cpu-clock:ppp'
#
# Overhead  Symbol
# ........  ......................................
#
    18.87%  [.] _PyEval_EvalFrameDefault
    17.14%  [k] finish_task_switch.isra.0
     4.71%  [k] _raw_spin_unlock_irq
     3.17%  [k] _raw_spin_unlock_irqrestore
     0.75%  [k] do_syscall_64
     0.41%  [.] pthread_mutex_lock@@GLIBC_2.2.5


# (Cannot load tips.txt file, please install perf!)
"""


def test_perf_rows_are_read_largest_first_and_switching_is_the_kernel_s_switch_symbols() -> None:
    rows = bench_perf.parse_report(PERF_SYM_REPORT)
    assert rows[0] == (18.87, "[.] _PyEval_EvalFrameDefault")
    assert [pct for pct, _ in rows] == sorted((pct for pct, _ in rows), reverse=True)
    assert len(rows) == 6
    assert bench_perf.switching_share(rows) == pytest.approx(17.14 + 4.71 + 3.17)


@pytest.mark.parametrize("floor", [partial(bench.echo_floor, n=10, concurrency=1), partial(bench.client_floor, n=10)])
def test_a_floor_gives_up_loudly_on_a_stand_in_that_cannot_start(floor) -> None:
    """Its ROUTER cannot bind (no such folder): the bench says so instead of hanging."""
    with pytest.raises(RuntimeError, match="stand-in did not start .its exit code: 1"):
        floor("ipc:///nonexistent-triptych-dir/echo")


def test_the_scratch_folder_goes_after_a_run_and_stays_after_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    with bench.kept_on_failure("triptych-test-") as tmp:
        (tmp / "log").write_text("fine")
    assert not tmp.exists()
    with pytest.raises(SystemExit), bench.kept_on_failure("triptych-test-") as tmp:
        raise SystemExit("requests failed")
    assert (tmp.exists(), capsys.readouterr().err) == (True, f"its configs and logs are kept in {tmp}\n")
    shutil.rmtree(tmp)
