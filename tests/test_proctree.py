"""agent/supervise/proctree.py: a tree walk misses a process started in a new session after the
walk (torch starts each worker so); ``kill_by_env`` finds it by the environment it inherited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from agent.supervise.proctree import kill_by_env, kill_tree, process_tree


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
        assert not psutil.pid_exists(straggler.pid) or psutil.Process(straggler.pid).status() == psutil.STATUS_ZOMBIE
        assert kill_by_env("FLEETD_TEST_NODE", marker) == 0
    finally:
        for p in (parent, straggler):
            if p.poll() is None:
                p.kill()
                p.wait()
