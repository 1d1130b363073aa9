"""The job's own code on this node: downloaded, verified, unpacked, set up; once per version.

The controller names the version in the node's user data (``job.code_uri``, ``job.code_digest``;
fleetd/protocol/job_code.py). ``prepare`` makes it ready before the first torchrun, which then
runs in the code folder with the virtualenv's python (agent/supervise/launch.py). A failed setup is
the job's failure (``SetupFailed``), never an agent crash loop.
(docs/DESIGN.md "The job file and its code on the nodes (fleetd/jobs, agent/supervise/workspace.py)")
"""

from __future__ import annotations

import asyncio
import os
import shutil
import site
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.config import AgentConfig
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.job_code import split_uri, unpack, verify
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

Fetch = Callable[[str, str], Awaitable[bytes]]  # (bucket, key) -> the object's bytes
SETUP_TAIL_LINES = 5


class SetupFailed(Exception):
    """The job's code could not be made ready: its setup failed, or its archive was refused."""

    def __init__(self, exit_code: int, detail: str):
        super().__init__(detail)
        self.exit_code = exit_code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class JobWorkspace:
    root: Path  # <state_dir>/jobs/<job>/<digest>
    uri: str
    digest: str
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    base_python: str = sys.executable
    # pip's cache, shared by every version's setup on the node (a new version re-installs fast).
    pip_cache: Path | None = None

    @classmethod
    def from_config(cls, cfg: AgentConfig) -> JobWorkspace | None:
        """None when the job's code is baked into the image (no ``job.code_uri``)."""
        job = cfg.job
        if not job.code_uri:
            return None
        root = cfg.node.state_dir / "jobs" / job.name / job.code_digest
        return cls(
            root, job.code_uri, job.code_digest, job.setup, dict(job.env), pip_cache=cfg.node.state_dir / "pip-cache"
        )

    @property
    def code(self) -> Path:
        return self.root / "code"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def setup_log(self) -> Path:
        return self.root / "setup.log"

    @property
    def ready_marker(self) -> Path:
        return self.root / "ready"

    def resolve(self, path: Path) -> Path:
        """A path from the job file (a folder-mode checkpoint folder): relative ones are inside
        the job's code folder, where its script runs."""
        return path if path.is_absolute() else self.code / path

    def launch_env(self) -> dict[str, str]:
        """What setup and the training processes run with: the job's env and its virtualenv."""
        pythonpath = os.pathsep.join(p for p in (str(self.code), os.environ.get("PYTHONPATH", "")) if p)
        return {
            **self.env,
            "VIRTUAL_ENV": str(self.venv),
            "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            # A module entrypoint and the warm pool import the job's modules from its folder.
            "PYTHONPATH": pythonpath,
        }


async def prepare(ws: JobWorkspace, fetch: Fetch) -> None:
    """Make ``ws`` ready: download the archive and refuse it unless its SHA-256 is the digest
    named; unpack it into a fresh folder renamed into place whole (a crash mid-way leaves nothing
    a later start would take for the code); make the job's virtualenv, the image's packages behind
    the job's own; run the setup commands (output to ``setup.log``); mark the version ready, so an
    agent restart does not set it up again. Raises SetupFailed; S3 errors propagate (transient:
    the caller retries)."""
    if ws.ready_marker.exists():
        return
    if not ws.code.is_dir():
        bucket, key = split_uri(ws.uri)
        data = await fetch(bucket, key)
        try:
            files = await asyncio.to_thread(_unpack_verified, data, ws)
        except ProtocolError as exc:
            raise SetupFailed(1, f"job code refused: {exc}") from exc
        log.info("job_code_unpacked", digest=ws.digest[:12], files=files, bytes=len(data))
    if not ws.python.exists():
        await _make_venv(ws)
    for command in ws.setup:
        await _run_setup(ws, command)
    ws.ready_marker.write_text(ws.digest)
    log.info("job_ready", digest=ws.digest[:12], setup_commands=len(ws.setup))


def _unpack_verified(data: bytes, ws: JobWorkspace) -> int:
    verify(data, ws.digest)
    ws.root.mkdir(parents=True, exist_ok=True)
    staging = ws.root / f"code.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    files = unpack(data, staging)
    staging.rename(ws.code)
    return files


async def _make_venv(ws: JobWorkspace) -> None:
    shutil.rmtree(ws.venv, ignore_errors=True)
    proc = await asyncio.create_subprocess_exec(
        ws.base_python,
        "-m",
        "venv",
        "--without-pip",
        str(ws.venv),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SetupFailed(proc.returncode or 1, f"python -m venv failed: {out.decode(errors='replace')[-300:]}")
    # The image's packages, behind the job's own (site.addsitedir also runs their .pth files,
    # which an editable install of fleetd needs; a bare path line would not).
    bases = [p for p in site.getsitepackages() if Path(p).is_dir()]
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in bases)
    for lib in (ws.venv / "lib").glob("python*/site-packages"):
        (lib / "_fleetd_image.pth").write_text(lines)


async def _run_setup(ws: JobWorkspace, command: str) -> None:
    env = {**os.environ, **ws.launch_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if ws.pip_cache is not None:
        env["PIP_CACHE_DIR"] = str(ws.pip_cache)
    with ws.setup_log.open("ab") as out:
        out.write(f"$ {command}\n".encode())
        out.flush()
        proc = await asyncio.create_subprocess_exec(
            "/bin/bash", "-c", command, cwd=ws.code, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out
        )
        code = await proc.wait()
    log.info("job_setup_command", command=command[:200], exit_code=code)
    if code != 0:
        tail = _tail(ws.setup_log, SETUP_TAIL_LINES)
        raise SetupFailed(code, f"setup `{command[:80]}` exited {code}: {tail}")


def _tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return " | ".join(line.strip() for line in text if line.strip())[-400:]
