"""torchrun supervision: start the job's torchrun on this node, stop its whole process tree, report
how it exited.

torchrun is started with the job spec from config and the settings DESIGN.md's measurements call
for: ``--nnodes=MIN:MAX``, the c10d rendezvous hosted by fleetd's rendezvous host (``is_host=false``:
nodes are store clients only), short last-call/heartbeat timeouts (fleetd completes rounds itself),
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it scale-up and the loss of the rank-0 node break
the job in torch 2.13) and ``--local-addr`` set to the node's own address.

torchrun runs in its own session, and torch starts each worker in yet another session, so "the
process tree" is found by walking descendants (psutil) *before* anything is killed; then every
process group in it is killed. SIGTERM to torchrun does not leave the rendezvous (fleetd removes
the node from the state instead), so a leave simply SIGKILLs the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from agent.trainer import context as trainer_env
from fleetd.protocol.logs import get_logger

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.main import AgentContext

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    entrypoint: str
    args: tuple[str, ...] = ()
    module: bool = True
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 4
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 29400
    run_id: str = "fleetd"
    node_addr: str = "127.0.0.1"
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 2.0
    close_timeout_s: float = 10.0
    keep_alive_s: float = 1.0
    keep_alive_max_attempt: int = 3
    max_restarts: int = 100  # failures (a lost peer) use these; membership changes do not
    monitor_interval_s: float = 0.1
    # Poll the rendezvous every this many seconds instead of torch's fixed 1 s (agent.torchrun_main).
    rdzv_poll_s: float | None = 0.1
    ckpt_dir: Path = Path("/var/lib/fleet-agent/checkpoints")
    ckpt_interval: int = 0
    ckpt_keep: int = 3
    hold_timeout_s: float = 90.0
    trainer_socket: Path | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "checkpoints"
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    job: str = "train"
    extra_env: tuple[tuple[str, str], ...] = ()
    python: str = sys.executable
    # Fork workers from a process that has torch imported (agent/warm_pool.py): a restarted
    # worker starts in milliseconds instead of seconds. Module entrypoints only.
    warm_pool: bool = True
    warm_preload: tuple[str, ...] = (
        "torch",
        "torch.distributed",
        "torch.nn",
        "torch.nn.parallel",
        "torch.distributed.checkpoint",
        "torch.distributed.run",
        "agent.torchrun_main",
        "agent.trainer",
        "agent.trainer.store_link",
        "fleetd.protocol.rendezvous_keys",
        "fleetd.protocol.trainer",
    )

    @property
    def uses_warm_pool(self) -> bool:
        return self.warm_pool and self.module

    @classmethod
    def from_config(cls, cfg: "AgentConfig", node_addr: str, **overrides: Any) -> "LaunchSpec":
        r, j, c = cfg.rendezvous, cfg.job, cfg.checkpoints
        values: dict[str, Any] = dict(
            entrypoint=j.entrypoint,
            args=tuple(j.args),
            module=j.module,
            nproc_per_node=j.nproc_per_node,
            min_nodes=cfg.node.min_nodes,
            max_nodes=cfg.node.max_nodes,
            rdzv_host=r.host,
            rdzv_port=r.port,
            run_id=r.run_id,
            node_addr=node_addr,
            join_timeout_s=r.join_timeout_s,
            last_call_timeout_s=r.last_call_timeout_s,
            close_timeout_s=r.close_timeout_s,
            keep_alive_s=r.heartbeat_s,
            ckpt_dir=c.local_dir / j.name,
            ckpt_interval=c.interval_steps,
            ckpt_keep=c.keep,
            trainer_socket=cfg.node.trainer_socket,
            s3_bucket=c.bucket,
            s3_prefix=c.prefix,
            s3_endpoint=cfg.aws.endpoint_url,
            s3_region=cfg.aws.region,
            job=j.name,
        )
        values.update(overrides)
        return cls(**values)


def _secs(value: float) -> int:
    # torch reads these rdzv-conf values with get_as_int: whole seconds, at least 1.
    return max(1, math.ceil(value))


def build_command(spec: LaunchSpec) -> list[str]:
    rdzv_conf = ",".join(
        [
            "is_host=false",
            f"join_timeout={_secs(spec.join_timeout_s)}",
            f"last_call_timeout={_secs(spec.last_call_timeout_s)}",
            f"close_timeout={_secs(spec.close_timeout_s)}",
            f"keep_alive_interval={_secs(spec.keep_alive_s)}",
            f"keep_alive_max_attempt={spec.keep_alive_max_attempt}",
        ]
    )
    launcher = ["-m", "agent.torchrun_main"] if spec.rdzv_poll_s else ["-m", "torch.distributed.run"]
    if spec.uses_warm_pool:
        # torchrun itself is forked from the warm pool too (it imports torch as well).
        launcher = ["-m", "agent.warm_launch", launcher[1]]
    cmd = [
        spec.python,
        *launcher,
        f"--nnodes={spec.min_nodes}:{spec.max_nodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={spec.rdzv_host}:{spec.rdzv_port}",
        f"--rdzv-id={spec.run_id}",
        f"--rdzv-conf={rdzv_conf}",
        f"--local-addr={spec.node_addr}",
        f"--max-restarts={spec.max_restarts}",
        f"--monitor-interval={spec.monitor_interval_s}",
    ]
    if spec.uses_warm_pool:
        cmd += ["-m", "agent.warm_launch", spec.entrypoint]
    else:
        if spec.module:
            cmd.append("-m")
        cmd.append(spec.entrypoint)
    cmd.extend(spec.args)
    return cmd


def build_env(spec: LaunchSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):  # systemd's, not the trainer's
        env.pop(k, None)
    env.update(
        {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "PYTHONUNBUFFERED": "1",
            trainer_env.ENV_STORE: f"{spec.rdzv_host}:{spec.rdzv_port}",
            trainer_env.ENV_RUN_ID: spec.run_id,
            trainer_env.ENV_NODE_ADDR: spec.node_addr,
            trainer_env.ENV_CKPT_DIR: str(spec.ckpt_dir),
            trainer_env.ENV_CKPT_INTERVAL: str(spec.ckpt_interval),
            trainer_env.ENV_CKPT_KEEP: str(spec.ckpt_keep),
            trainer_env.ENV_HOLD_TIMEOUT: str(spec.hold_timeout_s),
            trainer_env.ENV_S3_PREFIX: spec.s3_prefix,
            trainer_env.ENV_S3_REGION: spec.s3_region,
            trainer_env.ENV_JOB: spec.job,
        }
    )
    optional = {
        trainer_env.ENV_TRAINER_SOCKET: spec.trainer_socket,
        trainer_env.ENV_S3_BUCKET: spec.s3_bucket,
        trainer_env.ENV_S3_ENDPOINT: spec.s3_endpoint,
    }
    env.update({k: str(v) for k, v in optional.items() if v})
    if spec.rdzv_poll_s:
        env["FLEETD_RDZV_POLL_S"] = str(spec.rdzv_poll_s)
    env.update(dict(spec.extra_env))
    return env


@dataclass(frozen=True, slots=True)
class TorchrunExit:
    exit_code: int | None
    reason: str  # "finished", "failed", "stopped" (we stopped it), "lost" (killed by someone else)


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every descendant, found before anything is signalled."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(procs: list[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Signal every process group in the tree, then every process (groups catch grandchildren
    started after the walk; direct signals catch processes that left their group)."""
    groups: set[int] = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            continue
    own = os.getpgid(0)
    for g in groups - {own}:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


@dataclass
class TorchrunProcess:
    """One torchrun, started in its own session; ``stop`` ends its whole tree."""

    spec: LaunchSpec
    log_path: Path | None = None
    env: Mapping[str, str] | None = None
    proc: subprocess.Popen | None = None
    pool: subprocess.Popen | None = None
    pool_socket: str | None = None
    started_at: float | None = None
    _stopping: bool = field(default=False, repr=False)

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
        preload = [*self.spec.warm_preload, self.spec.entrypoint]
        cmd = [self.spec.python, "-m", "agent.warm_pool", "--socket", sock]
        for name in preload:
            cmd += ["--preload", name]
        # numpy (imported by torch) starts an OpenBLAS thread pool at import; the pool process must
        # stay single-threaded to fork safely. Workers keep numpy's BLAS at one thread (torch's own
        # intra-op threads are unaffected: they start lazily in each worker).
        pool_env = {**env, "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1")}
        self.pool = subprocess.Popen(
            cmd, env=pool_env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        env["FLEETD_WARM_POOL"] = sock

    def start(self) -> "TorchrunProcess":
        cmd = build_command(self.spec)
        env = build_env(self.spec, self.env)
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        self.spec.ckpt_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.spec.uses_warm_pool:
                self._start_pool(env, out)
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals to us do not reach it
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.started_at = time.monotonic()
        log.info("torchrun_started", pid=self.proc.pid, node_addr=self.spec.node_addr,
                 nnodes=f"{self.spec.min_nodes}:{self.spec.max_nodes}", entrypoint=self.spec.entrypoint)
        return self

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
        procs = self._trees()
        kill_tree(procs, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        if alive:
            kill_tree(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)

    def wait_blocking(self) -> TorchrunExit:
        assert self.proc is not None
        code = self.proc.wait()
        self._reap_pool()  # the pool serves this torchrun only
        if self._stopping:
            reason = "stopped"
        elif code == 0:
            reason = "finished"
        elif code < 0:
            reason = "lost"
        else:
            reason = "failed"
        log.info("torchrun_exited", pid=self.proc.pid, exit_code=code, reason=reason)
        return TorchrunExit(code, reason)

    async def wait(self) -> TorchrunExit:
        return await asyncio.to_thread(self.wait_blocking)

    async def stop(self, timeout_s: float = 10.0) -> TorchrunExit | None:
        if self.proc is None:
            return None
        await asyncio.to_thread(self.terminate, timeout_s)
        return await self.wait()


def create_hooks(ctx: "AgentContext"):  # -> agent.main.NodeHooks
    """The agent's hooks (agent.main): supervise torchrun, run the emergency path."""
    from agent.emergency import ElasticHooks

    return ElasticHooks.from_context(ctx)
