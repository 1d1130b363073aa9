"""A real mosquitto broker on a random port with a temporary config.

A missing mosquitto is an error with an install hint, never a skip: the tests exist to prove the
agent and controller against the broker that production runs.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from fleetd.demo.broker import find_mosquitto as _find
from fleetd.demo.broker import mosquitto_config
from tests.harness.ports import free_port, wait_port

INSTALL_HINT = "mosquitto is not installed: run `make test` (it installs it) or `apt-get install -y mosquitto`"


def find_mosquitto() -> str:
    exe = _find()
    if exe is None:
        raise RuntimeError(INSTALL_HINT)
    return exe


class Mosquitto:
    """One broker process. ``stop()``/``start()`` keep the same port, for restart tests."""

    def __init__(self, extra_config: str = "", port: int | None = None, listener_block: str | None = None):
        self.exe = find_mosquitto()
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fleetd-mosquitto-"))
        self.conf = self.dir / "mosquitto.conf"
        self.log = self.dir / "mosquitto.log"
        base = mosquitto_config(self.port, self.log, self.host)
        if listener_block is not None:
            # A custom listener (TLS, ACL tests) replaces the anonymous plain one.
            base = base.replace(f"listener {self.port} {self.host}\nallow_anonymous true\n", listener_block + "\n")
        self.conf.write_text(base + "log_type notice\n" + extra_config + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Mosquitto:
        self.proc = subprocess.Popen(
            [self.exe, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_port(self.host, self.port, timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"mosquitto did not start: {self.log_text()}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
