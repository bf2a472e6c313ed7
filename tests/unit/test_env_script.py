"""scripts/_env.sh, which scripts/test, demo and bench source first: its waits end."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[2] / "scripts"


def test_an_nvidia_smi_that_never_answers_stops_the_script_naming_it(tmp_path: Path) -> None:
    """nvidia-smi hangs on a machine whose GPU or driver is stuck; the script asked it which
    Mooncake build to install without a deadline, so scripts/test and demo hung before
    printing anything."""
    (tmp_path / "scripts").mkdir()
    for script in ("_env.sh", "_mooncake_build.sh"):
        shutil.copy(SCRIPTS / script, tmp_path / "scripts" / script)
    env = {**os.environ, "PATH": nvidia_smi(tmp_path, "exec sleep 30"), "TRIPTYCH_NVIDIA_SMI_S": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", f"source {tmp_path}/scripts/_env.sh"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise AssertionError("scripts/_env.sh still waited for nvidia-smi after 15 s") from None
    assert time.monotonic() - started < 10
    assert proc.returncode == 1
    assert "nvidia-smi -L did not answer within 1s" in err


def nvidia_smi(tmp_path: Path, body: str) -> str:
    """A PATH whose nvidia-smi runs ``body``."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
    (stubs / "nvidia-smi").chmod(0o755)
    return f"{stubs}:{os.environ['PATH']}"


@pytest.mark.parametrize(("body", "build"), [
    ("echo 'GPU 0: NVIDIA H100 80GB HBM3'", "mooncake-transfer-engine-cuda13=="),
    ("exit 9", "mooncake-transfer-engine-non-cuda=="),  # a driver that sees no GPU
], ids=["a GPU", "no GPU"])
def test_the_mooncake_build_is_the_cuda_one_where_nvidia_smi_sees_a_gpu(tmp_path: Path, body: str,
                                                                        build: str) -> None:
    """An nvidia-smi that answered left the GPU flag unset, so GPU hosts got the CPU build."""
    env = {**os.environ, "PATH": nvidia_smi(tmp_path, body)}
    chosen = subprocess.run(["bash", SCRIPTS / "_mooncake_build.sh"], env=env, capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert chosen.startswith(build)
