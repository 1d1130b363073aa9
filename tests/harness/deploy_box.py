"""Machines with systemd as PID 1, on this box: a Debian 12 root filesystem made by mmdebstrap from
Debian's packages, booted by systemd-nspawn (the deploy-in-a-box tests, tests/test_deploy_image.py).

The root filesystem and the wheels the image build installs offline are cached under
``.cache/deploy-box`` (keyed by what they are made from); each test works on its own copy. A
missing tool is an error with the install hint, never a skip: `make test` installs them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FLEETD_DEPLOY_BOX_CACHE", ROOT / ".cache" / "deploy-box"))
SUITE = "bookworm"
# What a minimal node needs before fleetd's own provisioning: systemd as init, D-Bus and polkit
# (logind's power-off goes through them), Python with venv, and runuser (util-linux, essential).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "polkitd", "pkexec", "python3", "python3-venv", "ca-certificates")
# What Debian's installer writes and mmdebstrap does not: names every host resolves.
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
INSTALL_HINT = "apt-get install -y mmdebstrap systemd-container (scripts/setup.sh does it)"


def need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise RuntimeError(f"{tool} is not installed: {INSTALL_HINT}")
    return found


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def base_rootfs() -> Path:
    """The cached minimal Debian 12 tree (built once: about half a minute)."""
    target = CACHE / f"rootfs-{SUITE}-{_key(*PACKAGES, HOSTS)}"
    if (target / ".complete").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run(
        [need("mmdebstrap"), "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(building)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (building / "etc" / "hosts").write_text(HOSTS)
    building.rename(target)
    (target / ".complete").touch()
    return target


def wheelhouse(wheel: Path) -> Path:
    """Every wheel fleetd's install needs, for an offline `pip install --no-index` in the image:
    the versions constraints.txt pins, and the torch this checkout's venv runs."""
    import torch  # the tested CPU build the suite runs on

    constraints = (ROOT / "constraints.txt").read_text()
    deps = (ROOT / "pyproject.toml").read_text()
    target = CACHE / f"wheels-{_key(constraints, deps, torch.__version__)}"
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "-d",
                str(target),
                "-c",
                str(ROOT / "constraints.txt"),
                f"torch=={torch.__version__}",
                str(wheel),
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        (target / ".complete").touch()
    for old in target.glob("fleetd-*.whl"):
        old.unlink()  # the checkout's own wheel goes in FILES, never from the cache
    return target


def build_wheel(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("fleetd-*.whl")
    return found


def copy_tree(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], check=True, timeout=600)
    return dst


def nspawn(
    root: Path,
    *argv: str,
    binds: tuple[tuple[Path, str], ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """Run one command in the tree (no boot): how an image build's script runs."""
    cmd = [need("systemd-nspawn"), "--quiet", "--register=no", "--keep-unit", "-D", str(root)]
    cmd += [f"--bind-ro={src}:{dst}" for src, dst in binds]
    cmd += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=timeout)


class Machine:
    """A tree booted with systemd as PID 1 (host network: containers share it)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.console = root.parent / f"{name}.console"

    def boot(self, timeout: float = 120) -> Machine:
        cmd = [
            need("systemd-nspawn"),
            "--quiet",
            "--register=no",
            "--keep-unit",
            "-D",
            str(self.root),
            f"--machine={self.name}",
            "-b",
            "--console=pipe",
        ]
        with open(self.console, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the machine stopped while booting:\n{self.console.read_text(errors='replace')}")
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not finish booting in {timeout:.0f} s")

    @property
    def init_pid(self) -> int:
        """The container's PID 1, as the host sees it (systemd-nspawn's child)."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        if not children:
            raise RuntimeError("systemd-nspawn has not started the container's init yet")
        return int(children[0])

    def run(
        self, *argv: str, user: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A command inside the booted machine (its namespaces, its root)."""
        try:
            pid = self.init_pid
        except (RuntimeError, FileNotFoundError):
            return subprocess.CompletedProcess(argv, 255, "", "not booted")
        prefix = ["runuser", "-u", user, "--"] if user else []
        cmd = [
            "nsenter",
            "-t",
            str(pid),
            "-a",
            "--wd=/",
            "env",
            "-i",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            *prefix,
            *argv,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{argv} in {self.name}: rc={out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def poweroff(self, timeout: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.run("systemctl", "poweroff", check=False)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def assert_host_port_free(port: int, who: str) -> None:
    """The machines share the host's network: a port already taken on the host makes the service
    inside fail to bind, and its clients reach the other listener instead (seen: a control host
    left running by a killed test run kept 8883, and the next run's fleetd met its broker's
    certificate, "certificate signature failure"). Say so plainly before booting."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            import psutil

            holders = {
                f"pid {c.pid} ({psutil.Process(c.pid).name() if c.pid else '?'})"
                for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
            }
            raise AssertionError(
                f"port {port} is taken on this host by {', '.join(sorted(holders)) or 'another process'}: "
                f"{who} needs it (a machine left running by a killed test run?)"
            ) from None


@contextmanager
def booted(root: Path, name: str) -> Iterator[Machine]:
    machine = Machine(root, name)
    try:
        yield machine.boot()
    finally:
        machine.poweroff()


# ---------------------------------------------------------------------- the two machines' trees
DEPLOY = ROOT / "deploy"
PROVISION = DEPLOY / "image" / "provision.sh"
# The files Packer uploads next to the script (deploy/packer/fleet-agent.pkr.hcl), by their names
# in the image's upload folder.
IMAGE_UPLOADS = {
    "fleet-agent.service": ROOT / "systemd" / "fleet-agent.service",
    "agent.toml": DEPLOY / "examples" / "agent.toml",
    "50-fleet-agent-poweroff.rules": DEPLOY / "polkit" / "50-fleet-agent-poweroff.rules",
    "50-fleet-agent-poweroff.pkla": DEPLOY / "polkit" / "50-fleet-agent-poweroff.pkla",
    "fleetd-sysusers.conf": DEPLOY / "sysusers" / "fleetd.conf",
}
CONTROL_SRC = "/root/fleetd-src"  # where the control host sees the checkout's deploy/ and systemd/


def build_node_image(work: Path) -> Path:
    """The node image as Packer builds it: the same script, the same uploads, run as root."""
    wheel = build_wheel(work / "dist")
    wheels = wheelhouse(wheel)
    root = work / "root"
    root.mkdir()
    copy_tree(base_rootfs(), root)
    files = root / "var" / "tmp" / "fleetd-image"
    files.mkdir(parents=True)
    for name, src in IMAGE_UPLOADS.items():
        shutil.copy(src, files / name)
    shutil.copy(wheel, files / wheel.name)
    shutil.copy(PROVISION, files / "provision.sh")
    res = nspawn(
        root,
        "/bin/bash",
        "/var/tmp/fleetd-image/provision.sh",
        binds=((wheels, "/wheelhouse"),),
        env={"FILES": "/var/tmp/fleetd-image", "WHEEL": wheel.name, "PIP_ARGS": "--no-index --find-links /wheelhouse"},
    )
    if res.returncode != 0:
        raise AssertionError(f"provision.sh failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return root


def build_control_host(work: Path, fleetd_toml: str, before: Callable[[Path], None] | None = None) -> Path:
    """A control host set up by deploy/control-host/setup.sh (what deploy/README.md says to run),
    installed but not started: its units start when the machine boots."""
    wheel = build_wheel(work / "dist")
    wheels = wheelhouse(wheel)
    root = work / "root"
    root.mkdir()
    copy_tree(base_rootfs(), root)
    src = root / CONTROL_SRC.lstrip("/")
    src.mkdir(parents=True)
    for part in ("deploy", "systemd"):
        shutil.copytree(ROOT / part, src / part)
    shutil.copy(wheel, src / wheel.name)
    (src / "fleetd.toml").write_text(fleetd_toml)
    if before is not None:  # what the operator puts in place first (a job's project, say)
        before(root)
    res = nspawn(
        root,
        "/bin/bash",
        f"{CONTROL_SRC}/deploy/control-host/setup.sh",
        binds=((wheels, "/wheelhouse"),),
        env={
            "WHEEL": f"{CONTROL_SRC}/{wheel.name}",
            "BROKER_NAME": "localhost",
            "FLEETD_TOML": f"{CONTROL_SRC}/fleetd.toml",
            "PIP_ARGS": "--no-index --find-links /wheelhouse",
            "START": "no",
        },
    )
    if res.returncode != 0:
        raise AssertionError(f"setup.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return root


def unit_dropin(root: Path, unit: str, name: str, env: dict[str, str]) -> None:
    """Test scaffolding a unit reads (what the instance role and the real endpoints give in AWS)."""
    dropin = root / "etc" / "systemd" / "system" / f"{unit}.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / name).write_text("[Service]\n" + "".join(f"Environment={k}={v}\n" for k, v in env.items()))


def wait_active(machine: Machine, units: tuple[str, ...], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = {u: machine.run("systemctl", "is-active", u, check=False).stdout.strip() for u in units}
        if all(s == "active" for s in states.values()):
            return
        if time.monotonic() > deadline:
            logs = {u: machine.run("journalctl", "-u", u, "--no-pager", "-n", "30", check=False).stdout for u in units}
            raise AssertionError(f"units not active in {machine.name}: {states}\n{logs}")
        time.sleep(1)
