"""Child processes of the demo: each in its own process group so that stopping it stops its whole
tree (torchrun workers included), with a bounded SIGTERM → SIGKILL escalation."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from fleetd.shared.waits import within


class Child:
    """A subprocess started in a new session; ``stop()`` signals the whole group."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path):
        self.name = name
        self.proc = proc
        self.log = log

    @classmethod
    async def start(
        cls, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> Child:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        return cls(name, proc, log)

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    async def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal the group, wait up to ``timeout``, then SIGKILL the group. Always reaps."""
        if self.running:
            self.signal_group(sig)
            try:
                await within(self.proc.wait(), timeout)
            except TimeoutError:
                pass
        # Grandchildren (torchrun workers) may outlive the leader: sweep the group either way.
        self.signal_group(signal.SIGKILL)
        if self.running:
            await self.proc.wait()
        return self.proc.returncode

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Supervised:
    """Keep a child running, as systemd's ``Restart=always`` does for the real units: when it
    exits (SIGKILL, OOM, crash, or a clean exit), start it again after ``restart_s``. The demo
    runs ``fleetd rendezvous`` this way (systemd/fleetd-rendezvous.service in production), so a
    store that dies comes back and the job's recovery path can be seen working."""

    def __init__(
        self, name: str, argv: list[str], log: Path, *, restart_s: float = 1.0, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.argv, self.log, self.restart_s, self.env = name, argv, log, restart_s, env
        self.child: Child | None = None
        self.restarts: list[tuple[float, int | None]] = []  # (wall time restarted, exit status)
        self.stopping = False

    async def start(self) -> Child:
        self.child = await Child.start(self.name, self.argv, self.log, env=self.env)
        return self.child

    @property
    def pid(self) -> int | None:
        return self.child.proc.pid if self.child is not None else None

    async def watch(self) -> None:
        import time

        from fleetd.shared.logs import get_logger

        log = get_logger(__name__)
        while not self.stopping:
            assert self.child is not None
            code = await self.child.proc.wait()
            if self.stopping:
                return
            # Sweep what it left (its group), like systemd's KillMode=control-group on exit.
            self.child.signal_group(signal.SIGKILL)
            log.warning("demo_child_exited", name=self.name, exit_code=code, restart_in_s=self.restart_s)
            await asyncio.sleep(self.restart_s)
            if self.stopping:
                return
            await self.start()
            self.restarts.append((time.time(), code))
            log.warning("demo_child_restarted", name=self.name, pid=self.pid, restarts=len(self.restarts))

    async def stop(self, timeout: float = 5.0) -> int | None:
        self.stopping = True
        return await self.child.stop(timeout) if self.child is not None else None
