"""Child processes of the demo: each in its own process group so that stopping it stops its whole
tree (torchrun workers included), with a bounded SIGTERM → SIGKILL escalation."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path


class Child:
    """A subprocess started in a new session; ``stop()`` signals the whole group."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path):
        self.name = name
        self.proc = proc
        self.log = log

    @classmethod
    async def start(cls, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
                    cwd: Path | None = None) -> "Child":
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
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
                await asyncio.wait_for(self.proc.wait(), timeout)
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
