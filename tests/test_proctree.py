"""agent/supervise/proctree.py: a tree walk misses a process started in a new session after the
walk (torch starts each worker so); ``kill_by_env`` finds it by the environment it inherited."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from agent.supervise.proctree import kill_by_env, kill_tree, process_tree


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (whoever reaps it may do so between two looks)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_process_started_after_the_walk_in_its_own_session_is_found_by_its_environment() -> None:
    marker = f"node-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "FLEETD_TEST_NODE": marker}
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    tree = process_tree(parent.pid)  # walked now, before the straggler exists
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)
    try:
        kill_tree(tree, signal.SIGKILL)
        parent.wait(timeout=10)
        assert straggler.poll() is None  # the walk could not see it
        assert kill_by_env("FLEETD_TEST_NODE", marker) == 1
        # (kill_by_env reaped it: it is this test's child here, torchrun's orphan on a node)
        assert _dead(straggler.pid)
        assert kill_by_env("FLEETD_TEST_NODE", marker) == 0
    finally:
        for p in (parent, straggler):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_terminate_kills_a_worker_started_after_its_walk(tmp_path) -> None:  # noqa: ANN001
    """A stand-in torchrun that, on SIGTERM, starts one more 'worker' in a session of its own and
    then ignores the signal: terminate's walk came first, its SIGKILL of torchrun orphans the new
    process, and only the launch's mark in its environment finds it."""
    from agent.supervise.launch import LaunchSpec
    from agent.supervise.torchrun import LAUNCH_ENV, TorchrunProcess

    pidfile = tmp_path / "late.pid"
    script = tmp_path / "torchrun_standin.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "def late(*_):\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "signal.signal(signal.SIGTERM, late)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    spec = LaunchSpec(entrypoint=str(script), module=False, warm_pool=False, rdzv_poll_s=None, ckpt_dir=tmp_path / "c")
    proc = TorchrunProcess(spec)
    env = {**os.environ, LAUNCH_ENV: proc._launch_id}
    proc.proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True, stdout=subprocess.PIPE)
    assert proc.proc.stdout is not None and proc.proc.stdout.readline().strip() == b"ready"
    late = None
    try:
        proc.terminate(timeout_s=1.0)
        late = int(pidfile.read_text())
        assert _dead(late)
    finally:
        proc.proc.wait()
        if late is not None and psutil.pid_exists(late):
            with contextlib.suppress(psutil.Error):
                psutil.Process(late).kill()
