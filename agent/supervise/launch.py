"""What torchrun is started with on this node: the job spec from config and the settings DESIGN.md's
measurements call for: ``--nnodes=MIN:MAX``, the c10d rendezvous hosted by fleetd's rendezvous host
(``is_host=false``: nodes are store clients only), short last-call/heartbeat timeouts (fleetd completes
rounds itself), ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it scale-up and the loss of the
rank-0 node break the job in torch 2.13) and ``--local-addr`` set to the node's own address.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.supervise.workspace import JobWorkspace
from agent.trainer import context as trainer_env

# torchrun's prefix for each teed worker line (its ${rank}: the global rank); worker_output.py
# strips it into the line's rank.
RANK_PREFIX_TEMPLATE = "[${rank}]:"
WARM_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.nn.parallel",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "agent.supervise.torchrun_main",
    "agent.trainer",
    "agent.trainer.store_link",
    # resume() reads S3's ``latest`` on every start (a newer durable step beats a stale local
    # copy): aiobotocore imported once in the pool, not in every restarted worker.
    "agent.checkpoint_store.store",
    "fleetd.protocol.rendezvous_keys",
    "fleetd.protocol.trainer",
)


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
    # torchrun drops a node whose heartbeat is older than keep_alive_s x this from the state, and
    # the node then stops heartbeating until the next re-form (dynamic_rendezvous._sanitize and
    # _should_keep_alive). fleetd's steering decides when a silent member is gone (loss.dead_after_s
    # plus loss.hang_after_s: a store blip is tolerated while training advances), so torch's own
    # check is only the backstop while fleetd is down: 15 x 2 s = 30 s = loss.store_silence_s.
    keep_alive_max_attempt: int = 15
    max_restarts: int = 100  # failures (a lost peer) use these; membership changes do not
    monitor_interval_s: float = 0.1
    # Poll the rendezvous every this many seconds instead of torch's fixed 1 s (agent.supervise.torchrun_main).
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
    # The job's code folder (agent/supervise/workspace.py): torchrun runs there. None: the
    # agent's own working directory (an entrypoint baked into the image).
    cwd: Path | None = None
    # Fork workers from a process that has torch imported (agent/supervise/warm_pool.py): a restarted
    # worker starts in milliseconds instead of seconds. A module or a script (folder mode's).
    warm_pool: bool = True
    warm_preload: tuple[str, ...] = WARM_PRELOAD
    # torchrun tees each worker's output through files here, every line prefixed with its global
    # rank ("[3]:"), so the log pipeline (worker_output.py) knows which rank wrote it. Emptied at
    # each torchrun start; within one torchrun the files grow with the job's output. None: the
    # workers write to torchrun's stdout directly and no line names its rank.
    worker_log_dir: Path | None = None

    @classmethod
    def from_config(cls, cfg: AgentConfig, node_addr: str, **overrides: Any) -> LaunchSpec:
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
            worker_log_dir=cfg.node.state_dir / "worker-logs",
        )
        if j.preload:
            values["warm_preload"] = WARM_PRELOAD + tuple(j.preload)
        workspace = JobWorkspace.from_config(cfg)
        if workspace is not None:
            values.update(
                python=str(workspace.python), cwd=workspace.code, extra_env=tuple(workspace.launch_env().items())
            )
        elif j.env:
            values["extra_env"] = tuple(j.env.items())
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
    launcher = ["-m", "agent.supervise.torchrun_main"] if spec.rdzv_poll_s else ["-m", "torch.distributed.run"]
    if spec.warm_pool:
        # torchrun itself is forked from the warm pool too (it imports torch as well).
        launcher = ["-m", "agent.supervise.warm_launch", launcher[1]]
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
    if spec.worker_log_dir is not None:
        cmd += ["--tee=3", f"--log-dir={spec.worker_log_dir}"]
    if spec.warm_pool:
        cmd += ["-m", "agent.supervise.warm_launch"]
        cmd += [spec.entrypoint] if spec.module else ["--script", spec.entrypoint]
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
    if spec.worker_log_dir is not None:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    env.update(dict(spec.extra_env))
    return env
