"""The project's broker config dropped into a distribution's stock mosquitto set-up, as
deploy/README.md tells an operator to: Debian's and Ubuntu's /etc/mosquitto/mosquitto.conf already
set persistence, its location, the pid file and the log, then include conf.d. A key the stock file
sets that mosquitto refuses twice (``persistence_location``) made the broker exit at start."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.mosquitto import find_mosquitto
from tests.harness.ports import free_port, wait_port
from tests.test_deploy_mosquitto import Pki, deployed_config, pki  # noqa: F401 - the fixture

# Debian 12's /etc/mosquitto/mosquitto.conf (mosquitto 2.0.11), byte for byte; Ubuntu 22.04 and
# 24.04 ship the same file.
STOCK = """\
# Place your local configuration in /etc/mosquitto/conf.d/
#
# A full description of the configuration file is at
# /usr/share/doc/mosquitto/examples/mosquitto.conf.example

pid_file /run/mosquitto/mosquitto.pid

persistence true
persistence_location /var/lib/mosquitto/

log_dest file /var/log/mosquitto/mosquitto.log

include_dir /etc/mosquitto/conf.d
"""


def broker_user() -> str:
    try:
        return pwd.getpwnam("mosquitto").pw_name
    except KeyError:
        return "nobody"  # no package user: mosquitto falls back to nobody


def stock_layout(root: Path, fleetd_conf: str) -> Path:
    """The stock file with its paths moved under ``root``; ours in its conf.d as fleetd.conf."""
    text = STOCK
    for path in ("/run/mosquitto", "/var/lib/mosquitto", "/var/log/mosquitto", "/etc/mosquitto/conf.d"):
        moved = root / path.lstrip("/")
        moved.mkdir(parents=True, exist_ok=True)
        text = text.replace(path, str(moved))
        if os.geteuid() == 0 and not path.startswith("/etc"):
            # Started as root, mosquitto drops to its own user (as the package's unit does):
            # the package owns these three to it.
            shutil.chown(moved, user=broker_user())
    main = root / "etc/mosquitto/mosquitto.conf"
    main.write_text(text)
    (root / "etc/mosquitto/conf.d/fleetd.conf").write_text(fleetd_conf)
    return main


@pytest.fixture
def root() -> Iterator[Path]:
    # Not under pytest's tmp_path: its parents are 0700 root, and the broker runs as its own user.
    made = Path(tempfile.mkdtemp(prefix="fleetd-stock-broker-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def test_project_config_starts_inside_the_stock_configuration(pki: Pki, root: Path) -> None:  # noqa: F811
    tmp_path = root
    port = free_port()
    # The broker's files as deploy/README.md installs them: /etc/mosquitto/fleetd, group mosquitto.
    files = root / "etc/mosquitto/fleetd"
    files.mkdir(parents=True)
    for name in ("ca.crt", "server.crt", "server.key", "acl"):
        shutil.copy(pki.ca.dir / name, files / name)
        (files / name).chmod(0o640)
        if os.geteuid() == 0:
            shutil.chown(files / name, group=grp.getgrgid(pwd.getpwnam(broker_user()).pw_gid).gr_name)
    ours = deployed_config(files, port, persistence_here=False)
    main = stock_layout(tmp_path, ours)
    proc = subprocess.Popen([find_mosquitto(), "-c", str(main)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        try:
            wait_port("127.0.0.1", port, 15)
        except TimeoutError:
            proc.kill()
            out = proc.communicate()[0].decode(errors="replace")
            log_file = tmp_path / "var/log/mosquitto/mosquitto.log"
            log = log_file.read_text(errors="replace") if log_file.exists() else ""
            raise AssertionError(f"mosquitto refused the stock + fleetd configuration:\n{out}\n{log}") from None
        # Its port answers before its SIGTERM handler is in place: a SIGTERM in between ends it
        # without saving its database (seen once on a loaded box). "running" comes after both.
        log_file = tmp_path / "var/log/mosquitto/mosquitto.log"  # the stock file's log is in force
        _wait_for_line(log_file, " running", proc)
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
    # The stock file's persistence is the one in force (it lands under the moved location).
    assert (tmp_path / "var/lib/mosquitto/mosquitto.db").exists()


def _wait_for_line(log_file: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"mosquitto exited: {log_file.read_text(errors='replace') if log_file.exists() else ''}"
        )
        if log_file.exists() and text in log_file.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {log_file} after {timeout_s:.0f} s")
