"""Shared fixtures: a moto server and a real mosquitto, each on a random port.

- ``moto_endpoint``: URL of a ThreadedMotoServer; its state is reset after every test that uses it.
- ``aio_session`` / ``aws_client_kwargs``: an aiobotocore session and the kwargs (endpoint, region,
  no retries) to create clients against moto.
- ``mosquitto``: a session-wide broker; ``mosquitto_factory``: private brokers (for restart tests).
- how `make test` spreads the suite over xdist workers: tests/harness/lanes.py.
- hypothesis: the "ci" profile (default) draws the same examples on every run (derandomize) and
  has no per-example deadline, so a property that held here holds in CI on a slower machine;
  ``HYPOTHESIS_PROFILE=explore`` draws new examples each run to hunt for counterexamples (one
  found that way, a float-rounding edge in a test's own oracle, had turned a CI run red).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from moto.server import ThreadedMotoServer

from tests.harness import lanes
from tests.harness import moto as moto_harness
from tests.harness.mosquitto import Mosquitto

moto_harness.use_fake_credentials()

# Fixtures shared by many modules (``cloud``: moto behind fleetd's fault proxy; ``open_state``: each
# state backend), loaded as plugins so no test module has to import a fixture by name.
pytest_plugins = ["tests.reconcile_support", "tests.ha_support"]

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# tryfirst: before xdist's own (the first answer is taken); optional: plain runs may not load xdist.
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return lanes.make_scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> Iterator[None]:
    """A test that times out also prints every asyncio task's stack: pytest-timeout shows only the
    threads, and a hung coroutine sits in the event loop's select() like an idle one."""
    yield
    previous = signal.getsignal(signal.SIGALRM)
    if callable(previous) and threading.current_thread() is threading.main_thread():

        def dump_tasks_then_fail(signum: int, frame: object) -> None:
            loop = asyncio._get_running_loop()
            if loop is not None:
                for task in asyncio.all_tasks(loop):
                    print(f"--- asyncio task {task.get_name()}: {task!r}", file=sys.stderr)
                    task.print_stack(limit=12, file=sys.stderr)
            previous(signum, frame)

        signal.signal(signal.SIGALRM, dump_tasks_then_fail)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only when the suite is spread over workers: a serial run keeps the file order CI has run.
    if getattr(config.option, "numprocesses", None):  # 0/None: serial; an int or "auto": workers
        lanes.longest_first(items)


@pytest.fixture(scope="session")
def _moto_server() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def moto_endpoint(_moto_server: str) -> Iterator[str]:
    yield _moto_server
    moto_harness.reset(_moto_server)


@pytest.fixture
def aws_client_kwargs(moto_endpoint: str) -> dict:
    return {
        "endpoint_url": moto_endpoint,
        "region_name": "us-east-1",
        "config": moto_harness.NO_RETRIES,
    }


@pytest.fixture
def aio_session():
    from aiobotocore.session import get_session

    return get_session()


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[Mosquitto]:
    broker = Mosquitto().start()
    yield broker
    broker.close()


@pytest.fixture
def mosquitto_factory() -> Iterator:
    brokers: list[Mosquitto] = []

    def make(**kwargs) -> Mosquitto:
        b = Mosquitto(**kwargs)
        brokers.append(b)
        return b

    yield make
    for b in brokers:
        b.close()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A warm worker pool (agent/supervise/warm_pool.py) that preloads only ``json``: its socket,
    and an environment whose PYTHONPATH has ``tmp_path`` (where a test writes its modules)."""
    from agent.supervise.proctree import kill_tree, process_tree

    sock = str(tmp_path / "pool.sock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.supervise.warm_pool", "--socket", sock, "--preload", "json"],
        env=env,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
    )
    until = time.monotonic() + 60
    while not os.path.exists(sock) and time.monotonic() < until and proc.poll() is None:
        time.sleep(0.05)
    assert os.path.exists(sock), f"the warm pool never listened (exit {proc.poll()})"
    yield sock, env
    kill_tree(process_tree(proc.pid), signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="session")
def node_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node image built once per session by deploy/image/provision.sh (tests/harness/deploy_box.py).
    Tests boot copies of it (``copy_tree``), never the image itself."""
    from tests.harness.deploy_box import build_node_image

    return build_node_image(tmp_path_factory.mktemp("node-image"))
