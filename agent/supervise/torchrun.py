"""torchrun supervision: start the job's torchrun on this node (``agent.supervise.launch`` says
with what), stop its whole process tree (``agent.supervise.proctree``), report how it exited.

SIGTERM to torchrun does not leave the rendezvous (fleetd removes the node from the state instead),
so a leave simply SIGKILLs the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.node.log_sink import WorkerLogSink
from agent.supervise.launch import LaunchSpec, build_command, build_env
from agent.supervise.proctree import kill_by_env, kill_tree, process_tree
from agent.supervise.worker_output import WorkerOutput
from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TorchrunExit:
    exit_code: int | None
    reason: str  # "finished", "failed", "stopped" (we stopped it), "lost" (killed by someone else)
    # The failure guard ended it on the job's own failure: ``exit_code`` is the worker's, not torchrun's.
    job_failed: bool = False


# Every process of one launch (pool, torchrun, workers) inherits this, set to the launch's own id:
# a worker torchrun started after ``terminate`` walked the tree is found by it (proctree.kill_by_env).
LAUNCH_ENV = "FLEETD_TORCHRUN_LAUNCH"


@dataclass
class TorchrunProcess:
    """One torchrun, started in its own session; ``stop`` ends its whole tree."""

    spec: LaunchSpec
    log_path: Path | None = None
    # Each line also goes to journald and to the control host (agent/supervise/worker_output.py).
    sink: WorkerLogSink | None = None
    env: Mapping[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    pool: subprocess.Popen[bytes] | None = None
    pool_socket: str | None = None
    started_at: float | None = None
    _stopping: bool = field(default=False, repr=False)
    # Set by ``fail``: the job's own code failed (agent/supervise/worker_failures.py) and the agent
    # ended torchrun's restarts of it; the exit is reported as "failed" with this code.
    _user_failure: int | None = field(default=None, repr=False)
    # Clear while ``terminate`` is still waiting for the tree it signalled; see ``wait_blocking``.
    _tree_gone: threading.Event = field(default_factory=threading.Event, repr=False)
    # The pipe the pool and torchrun write to, read by a thread into the log file and the sink.
    _output: WorkerOutput | None = field(default=None, repr=False)
    _launch_id: str = field(default_factory=lambda: os.urandom(8).hex(), repr=False)

    def __post_init__(self) -> None:
        self._tree_gone.set()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _pool_socket(self) -> str:
        # Unix socket paths are limited to ~100 bytes: keep it short and unique per node.
        return f"/tmp/fleetd-warm-{self.spec.node_addr}-{os.getpid()}-{id(self) & 0xFFFF:x}.sock"

    def _start_pool(self, env: dict[str, str], out: Any) -> None:
        sock = self.pool_socket = self._pool_socket()
        # A module entrypoint is imported too (its own imports warmed; warm_pool runs it afresh).
        # A script is not: importing it would run it.
        preload = [*self.spec.warm_preload, *([self.spec.entrypoint] if self.spec.module else [])]
        cmd = [self.spec.python, "-m", "agent.supervise.warm_pool", "--socket", sock]
        for name in preload:
            cmd += ["--preload", name]
        # numpy (imported by torch) starts an OpenBLAS thread pool at import; the pool process must
        # stay single-threaded to fork safely. Workers keep numpy's BLAS at one thread (torch's own
        # intra-op threads are unaffected: they start lazily in each worker).
        pool_env = {**env, "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1")}
        self.pool = subprocess.Popen(
            cmd,
            env=pool_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.spec.cwd,
        )
        env["FLEETD_WARM_POOL"] = sock

    def _open_log(self) -> Any:
        """The children's stdout: the write end of this torchrun's output pipe (one pipe for the
        pool and torchrun, so the reader sees EOF only when both, and every worker, are gone)."""
        if self.log_path is None and self.sink is None:
            return subprocess.DEVNULL
        if self._output is None:
            self._output = WorkerOutput(self.log_path, self.sink)
        return self._output.writer()

    def _close_log(self) -> None:
        """The parent's write end, once no child is left to start (else the reader never ends)."""
        if self._output is not None:
            self._output.close_writer()

    def _env(self) -> dict[str, str]:
        return {**build_env(self.spec, self.env), LAUNCH_ENV: self._launch_id}

    def prewarm(self) -> TorchrunProcess:
        """Start the warm pool now (it imports torch: seconds), torchrun later with ``start``.
        The agent does this while it waits for a restarted rendezvous store, so the import
        overlaps the outage instead of following it."""
        if self.spec.warm_pool and self.pool is None:
            env = self._env()
            try:
                self._start_pool(env, self._open_log())
            except BaseException:
                self._close_log()
                raise
        return self

    def discard(self) -> None:
        """A prewarmed pool whose torchrun will never start (the agent is stopping)."""
        if self.proc is None:
            self._close_log()
            self._reap_pool()

    def start(self) -> TorchrunProcess:
        cmd = build_command(self.spec)
        env = self._env()
        out: Any = self._open_log()
        self.spec.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.worker_log_dir is not None:  # the tee files of earlier torchruns: shipped already
            shutil.rmtree(self.spec.worker_log_dir, ignore_errors=True)
        try:
            if self.spec.warm_pool and self.pool is None:
                self._start_pool(env, out)
            elif self.pool_socket is not None:
                env["FLEETD_WARM_POOL"] = self.pool_socket
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals to us do not reach it
                cwd=self.spec.cwd,
            )
        finally:
            self._close_log()  # the children hold their copies
        self.started_at = time.monotonic()
        log.info(
            "torchrun_started",
            pid=self.proc.pid,
            node_addr=self.spec.node_addr,
            nnodes=f"{self.spec.min_nodes}:{self.spec.max_nodes}",
            entrypoint=self.spec.entrypoint,
        )
        return self

    @property
    def stopping(self) -> bool:
        """True once we stopped it (kill, terminate): what its workers do after that is our doing."""
        return self._stopping

    def kill(self) -> None:
        """SIGKILL the whole tree now (the node has been removed from the rendezvous)."""
        if self.proc is None:
            return
        self._stopping = True
        kill_tree(self._trees(), signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP the whole tree (warm pool and its workers included): tests stand it in for a
        machine that vanished without a word, whose peers' collectives hang rather than fail."""
        if self.proc is not None:
            kill_tree(self._trees(), signal.SIGSTOP)

    def _trees(self) -> list[psutil.Process]:
        procs = process_tree(self.proc.pid) if self.proc else []
        if self.pool is not None:
            procs += process_tree(self.pool.pid)
        return procs

    def _reap_pool(self) -> None:
        if self.pool is None:
            return
        if self.pool.poll() is None:
            kill_tree(process_tree(self.pool.pid), signal.SIGKILL)
        self.pool.wait()
        sock = self.pool_socket
        if sock is not None:  # a SIGKILLed pool cannot remove its own socket
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)

    def terminate(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the tree, then SIGKILL what is left after ``timeout_s`` (blocking)."""
        if self.proc is None:
            return
        self._stopping = True
        self._tree_gone.clear()  # before any signal: the launcher may exit the moment it gets one
        try:
            procs = self._trees()
            kill_tree(procs, signal.SIGTERM)
            _, alive = psutil.wait_procs(procs, timeout=timeout_s)
            if alive:
                kill_tree(alive, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=5)
            # torch starts each worker in a session of its own: one started after the walk (a
            # failing job's torchrun restarts it every second) was orphaned when torchrun ended,
            # and would hold its GPU and dial a dead store until its own timeout.
            stragglers = kill_by_env(LAUNCH_ENV, self._launch_id)
            if stragglers:
                log.warning("torchrun_stragglers_killed", count=stragglers, node_addr=self.spec.node_addr)
        finally:
            self._tree_gone.set()

    def fail(self, exit_code: int, timeout_s: float = 10.0) -> None:
        """End torchrun because the job's code failed (blocking): the same tree stop as
        ``terminate``, reported as a failure, not as our stop. After our own stop (a leave's
        SIGKILL reaches the workers before torchrun, which logs their deaths as failures) it
        changes nothing: the exit stays "stopped" (burner run 37)."""
        if self._stopping:
            log.info("torchrun_failure_after_our_stop", exit_code=exit_code, pid=self.proc.pid if self.proc else None)
            return
        self._user_failure = exit_code
        self.terminate(timeout_s)

    def wait_blocking(self) -> TorchrunExit:
        assert self.proc is not None
        code = self.proc.wait()
        # A stop under way SIGTERMed the whole tree, and the launcher can exit long before the
        # workers do (with a warm pool, the pool dies at once and warm_launch with it, while the
        # pool's children, torchrun's agent and its workers, are still saving the step they
        # completed). Callers start the next torchrun as soon as this returns, and it resumes from
        # the newest checkpoint on disk: it must not look before that save is written.
        self._tree_gone.wait()
        self._reap_pool()  # the pool serves this torchrun only
        if self._output is not None and not self._output.join(timeout_s=2.0):
            # A stray grandchild still holds the pipe: what it writes still goes to the file, but
            # the caller reads the log now (log_tail) without its last lines.
            log.warning("torchrun_output_still_open", pid=self.proc.pid)
        if self._user_failure is not None:
            code, reason = self._user_failure, "failed"
        elif self._stopping:
            reason = "stopped"
        elif code == 0:
            reason = "finished"
        elif code < 0:
            reason = "lost"
        else:
            reason = "failed"
        log.info("torchrun_exited", pid=self.proc.pid, exit_code=code, reason=reason)
        return TorchrunExit(code, reason, job_failed=self._user_failure is not None)

    async def wait(self) -> TorchrunExit:
        return await asyncio.to_thread(self.wait_blocking)

    async def stop(self, timeout_s: float = 10.0) -> TorchrunExit | None:
        if self.proc is None:
            return None
        await asyncio.to_thread(self.terminate, timeout_s)
        return await self.wait()
