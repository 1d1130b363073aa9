"""A script entrypoint (folder mode's ``train.py``) through the warm pool: torchrun's command, the
worker forked as ``python <path>`` would run it, user signals relayed, and the cold fallback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent.supervise.launch import LaunchSpec, build_command

REPORT = """
import os, sys
print(sys.argv, __name__, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), flush=True)
import helper  # beside the script, as `python train.py` finds it
print(helper.WHO, flush=True)
sys.exit(5)
"""

ON_USR1 = """
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *_: (print("usr1", flush=True), sys.exit(4)))
print(os.getpid(), flush=True)
signal.pause()
"""


def test_a_script_is_launched_through_the_warm_pool():
    spec = LaunchSpec(entrypoint="train.py", module=False, args=("30", "3"))
    cmd = build_command(spec)
    assert cmd[1:3] == ["-m", "agent.supervise.warm_launch"]  # torchrun forked in the pool too
    assert cmd[-6:] == ["-m", "agent.supervise.warm_launch", "--script", "train.py", "30", "3"]
    cold = build_command(LaunchSpec(entrypoint="train.py", module=False, warm_pool=False, args=("30",)))
    assert cold[-2:] == ["train.py", "30"] and "agent.supervise.warm_launch" not in cold


def _script(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "helper.py").write_text("WHO = 'helper beside the script'\n")
    path = folder / "train.py"
    path.write_text(body)
    return path


def _launch(sock: str | None, cwd: Path, *argv: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLEETD_WARM_WAIT_S": "0.1"}
    env["FLEETD_WARM_POOL"] = sock or str(cwd / "absent.sock")
    return subprocess.Popen(
        [sys.executable, "-m", "agent.supervise.warm_launch", "--script", *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_script_runs_as_python_would_run_it(tmp_path, pool, warm):
    """Forked from the pool or exec'd cold: the same argv, ``__main__``, the script's folder first
    on the path (a module beside it imports), and its exit status."""
    script = _script(tmp_path / "code", REPORT)
    proc = _launch(pool[0] if warm else None, tmp_path / "code", "train.py", "--epochs", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err.decode()[-2000:]
    first, second = out.decode().splitlines()
    assert first == f"{['train.py', '--epochs', '3']} __main__ True", first
    assert second == "helper beside the script"
    if warm:
        assert b"starting a cold worker" not in err
    else:
        assert b"starting a cold worker" in err
    assert script.exists()


def test_sigusr1_reaches_a_warm_script(tmp_path, pool):
    """Folder mode asks the script to save with SIGUSR1 sent to torchrun's children, here the
    script's warm_launch stand-in: it relays, the script's handler runs, its status comes back."""
    _script(tmp_path / "code", ON_USR1)
    proc = _launch(pool[0], tmp_path / "code", "train.py")
    assert proc.stdout is not None
    worker = int(proc.stdout.readline())
    assert worker != proc.pid and psutil.pid_exists(worker)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 4, err.decode()[-2000:]
    assert out.strip() == b"usr1"
