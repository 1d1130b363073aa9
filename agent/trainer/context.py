"""What a training rank learns from its environment: torchrun's variables plus fleetd's.

The supervisor (agent/supervise/launch.py) sets the ``FLEETD_*`` variables below on torchrun, which
passes them to every worker. Outside fleetd (plain ``torchrun``, or a single process) the fleetd
parts are simply absent and the helper degrades to periodic local checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_STORE = "FLEETD_STORE"  # host:port of the rendezvous store
ENV_RUN_ID = "FLEETD_RUN_ID"
ENV_NODE_ADDR = "FLEETD_NODE_ADDR"
ENV_CKPT_DIR = "FLEETD_CKPT_DIR"
ENV_CKPT_INTERVAL = "FLEETD_CKPT_INTERVAL"
ENV_CKPT_KEEP = "FLEETD_CKPT_KEEP"
ENV_TRAINER_SOCKET = "FLEETD_TRAINER_SOCKET"
ENV_HOLD_TIMEOUT = "FLEETD_HOLD_TIMEOUT_S"
ENV_EVENTS_FILE = "FLEETD_EVENTS_FILE"  # optional JSON-lines trace (tests, bench)
# S3 restore for a node without a local copy (a replacement, or a lost local disk).
ENV_S3_BUCKET = "FLEETD_S3_BUCKET"
ENV_S3_PREFIX = "FLEETD_S3_PREFIX"
ENV_S3_ENDPOINT = "FLEETD_S3_ENDPOINT"
ENV_S3_REGION = "FLEETD_S3_REGION"
ENV_JOB = "FLEETD_JOB"


@dataclass(frozen=True, slots=True)
class TrainerContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    restart_count: int = 0
    store_host: str | None = None
    store_port: int | None = None
    run_id: str = "fleetd"
    node_addr: str = "127.0.0.1"
    ckpt_dir: Path = Path("checkpoints")
    ckpt_interval: int = 0  # 0: no periodic saves
    ckpt_keep: int = 3
    trainer_socket: Path | None = None
    hold_timeout_s: float = 90.0
    events_file: Path | None = None
    s3_bucket: str | None = None
    s3_prefix: str = "checkpoints"
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    job: str = "train"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerContext:
        e = os.environ if env is None else env
        host = port = None
        if e.get(ENV_STORE):
            h, _, p = e[ENV_STORE].rpartition(":")
            host, port = h, int(p)

        def opt(k: str) -> str | None:
            return e.get(k) or None

        return cls(
            rank=int(e.get("RANK", 0)),
            world_size=int(e.get("WORLD_SIZE", 1)),
            local_rank=int(e.get("LOCAL_RANK", 0)),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", 1)),
            restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", 0)),
            store_host=host,
            store_port=port,
            run_id=e.get(ENV_RUN_ID, "fleetd"),
            node_addr=e.get(ENV_NODE_ADDR, "127.0.0.1"),
            ckpt_dir=Path(e.get(ENV_CKPT_DIR, "checkpoints")),
            ckpt_interval=int(e.get(ENV_CKPT_INTERVAL, 0)),
            ckpt_keep=int(e.get(ENV_CKPT_KEEP, 3)),
            trainer_socket=Path(e[ENV_TRAINER_SOCKET]) if opt(ENV_TRAINER_SOCKET) else None,
            hold_timeout_s=float(e.get(ENV_HOLD_TIMEOUT, 90.0)),
            events_file=Path(e[ENV_EVENTS_FILE]) if opt(ENV_EVENTS_FILE) else None,
            s3_bucket=opt(ENV_S3_BUCKET),
            s3_prefix=e.get(ENV_S3_PREFIX, "checkpoints"),
            s3_endpoint=opt(ENV_S3_ENDPOINT),
            s3_region=e.get(ENV_S3_REGION, "us-east-1"),
            job=e.get(ENV_JOB, "train"),
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or "MASTER_ADDR" in os.environ

    @property
    def steered(self) -> bool:
        """Running under fleetd (a rendezvous store to watch for checkpoint requests)."""
        return self.store_host is not None and self.store_port is not None
