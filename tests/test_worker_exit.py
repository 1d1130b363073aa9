"""agent/trainer/worker_exit.py: a training script ends with the status ``sys.exit(main())`` would
give and its output flushed, without running the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from agent.trainer.worker_exit import run_worker

    atexit.register(lambda: print("teardown ran"))

    def main():
        print("unflushed line on a pipe")
        print("to stderr", file=sys.stderr)
        {body}

    run_worker(main)
    """
)


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("body", "code", "stderr_has"),
    [
        ("return 0", 0, "to stderr"),
        ("return None", 0, "to stderr"),
        ("return 3", 3, "to stderr"),
        ("sys.exit(4)", 4, "to stderr"),
        ("sys.exit()", 0, "to stderr"),
        ("sys.exit('no data found')", 1, "no data found"),
        ("raise ValueError('the job broke')", 1, "ValueError: the job broke"),
    ],
)
def test_status_and_output_are_those_of_sys_exit_without_teardown(body: str, code: int, stderr_has: str) -> None:
    out = _run(body)
    assert out.returncode == code, out.stderr
    assert out.stdout == "unflushed line on a pipe\n"  # flushed; the atexit hook never ran
    assert stderr_has in out.stderr
