"""Per-test wall and CPU seconds, to see which tests wait and which burn CPU (the xdist lanes in
tests/harness/lanes.py are sized on this). Opt-in; appends one JSON object per test to $CPUTIME_OUT:

    CPUTIME_OUT=/tmp/cpu.jsonl .venv/bin/python -m pytest -p tests.harness.cputime -m slow ...

CPU is this worker's own plus that of the children it reaped (a test's subprocesses and theirs,
each reaped by its parent); a process left to init is not counted. The 1-minute load average at
both ends says how busy the machine was.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

OUTCOMES = pytest.StashKey[list]()  # "call:passed", "setup:failed", ... for each phase that counts


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    wall0, (own0, kids0), load0 = time.monotonic(), _cpu(), os.getloadavg()[0]
    outcomes = item.stash.setdefault(OUTCOMES, [])
    yield
    own1, kids1 = _cpu()
    rec = {
        "id": item.nodeid,
        "outcome": "/".join(outcomes),
        "wall_s": round(time.monotonic() - wall0, 2),
        "cpu_own_s": round(own1 - own0, 2),
        "cpu_children_s": round(kids1 - kids0, 2),
        "load_start": round(load0, 2),
        "load_end": round(os.getloadavg()[0], 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(os.environ.get("CPUTIME_OUT", "cputime.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.outcome != "passed":
        item.stash.setdefault(OUTCOMES, []).append(f"{report.when}:{report.outcome}")
