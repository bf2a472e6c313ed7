"""scripts/_env.sh, which scripts/test, demo and bench source first: its waits end."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

SCRIPTS = Path(__file__).parents[2] / "scripts"


def test_an_nvidia_smi_that_never_answers_stops_the_script_naming_it(tmp_path: Path) -> None:
    """nvidia-smi hangs on a machine whose GPU or driver is stuck; the script asked it which
    Mooncake build to install without a deadline, so scripts/test and demo hung before
    printing anything."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPTS / "_env.sh", tmp_path / "scripts" / "_env.sh")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 30\n")
    (stubs / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "TRIPTYCH_NVIDIA_SMI_S": "1"}
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
