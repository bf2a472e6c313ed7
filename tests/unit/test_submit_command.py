"""``triptych submit`` writing what it got: its outputs and its progress, in a process of its
own whose clients answer at once (no daemon), so its streams and limits can be its own."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

OUTPUT_BYTES = 10_000

# The command, each client's submit answering with progress and a raw output of OUTPUT_BYTES,
# or with a refusal if $REFUSED is set.
ANSWERED_AT_ONCE = f"""if True:
    import os, sys
    from orchestrator import cli, submit_command
    from orchestrator.client_wire import Generation
    from orchestrator.rejection import Rejection
    from transfer.protocol import Progress, Reason, Rejected, Result, TensorSpec

    def answer(rid):
        if "REFUSED" in os.environ:
            raise Rejection(Rejected(request_id=rid, reason=Reason.OVERLOADED, message="busy"))
        images = TensorSpec(name="images", dtype="uint8", shape=({OUTPUT_BYTES},), nbytes={OUTPUT_BYTES})
        return Generation(Result(request_id=rid, outputs=[images], stages=[], total_ms=1.0),
                          [bytearray({OUTPUT_BYTES})])

    async def watched(client, params, *, request_id, on_progress, **options):
        for step in range(3):
            on_progress(Progress(request_id=request_id, state="denoising", elapsed_ms=1.0, step=step, steps=3))
        return answer(request_id)

    submit_command.AsyncClient.submit = watched
    submit_command.Client.submit = lambda client, params, *, request_id, **options: answer(request_id)
    cli._daemon_at = lambda endpoint: endpoint
    sys.exit(cli.main(sys.argv[1:]))
"""


def submit(out: Path, *flags: str, stderr: int = subprocess.PIPE, limit_file_bytes: int | None = None,
           refused: bool = False) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG) rather than kill

    return subprocess.run(
        [sys.executable, "-c", ANSWERED_AT_ONCE, "submit", "--prompt", "p", "--output", "raw", "--request-id", "r",
         "--endpoint", f"ipc://{out}/nobody", "--out", str(out), *flags],
        stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
        preexec_fn=limit if limit_file_bytes is not None else None,
        env={**os.environ, "REFUSED": "1"} if refused else None)


def nobody_reads_stderr(out: Path, *flags: str, refused: bool = False) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)  # its first line meets a broken pipe
    try:
        return submit(out, *flags, stderr=write, refused=refused)
    finally:
        os.close(write)


def test_progress_nobody_reads_neither_stops_the_request_nor_passes_for_its_outcome(tmp_path: Path) -> None:
    """`submit --progress 2>&1 | head -2`: the broken pipe on stderr cancelled the request,
    and then passed for the `| head` of stdout, exit 0, with nothing written (a client audit)."""
    done = nobody_reads_stderr(tmp_path, "--progress")
    assert done.returncode == 0
    assert (tmp_path / "r-images.bin").read_bytes() == bytes(OUTPUT_BYTES)
    assert done.stdout.startswith(f"{tmp_path / 'r-images.bin'}  uint8 ({OUTPUT_BYTES},)\n")


def test_a_refusal_nobody_reads_is_still_the_exit_status(tmp_path: Path) -> None:
    """Not the 0 of `| head`'s rule."""
    assert nobody_reads_stderr(tmp_path, refused=True).returncode == 2
    assert nobody_reads_stderr(tmp_path, "--progress", refused=True).returncode == 2


def test_an_output_that_cannot_be_written_whole_leaves_no_file(tmp_path: Path) -> None:
    """A full disk left a short file under the output's name, for a later job to read."""
    done = submit(tmp_path, limit_file_bytes=OUTPUT_BYTES // 2)
    assert done.returncode == 1
    assert done.stderr == (f"triptych submit: request r completed, but {tmp_path / 'r-images.bin'} could not be "
                           "written: File too large\n")
    assert list(tmp_path.iterdir()) == []  # nor the hidden part it was written to
    done = submit(tmp_path)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["r-images.bin"]
