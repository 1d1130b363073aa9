"""The demo's config files: one fleetd.toml for the controller and one agent.toml per node.

Written as TOML so the demo exercises the same loading path as production (and an operator can
read exactly what the demo ran with in its work directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fleetd.adapters.pricing import DEMO_PRICE_BOOK

DEMO_FLEET = "demo"
DEMO_BUCKET = "fleetd-demo"
DEMO_TYPES = ("g4dn.xlarge", "g6.xlarge", "g5.xlarge")
DEMO_ZONES = ("us-east-1a", "us-east-1b")
# The demo's training jobs (`fleetd demo --job NAME`): the entrypoint module and what the node's warm
# worker pool imports once. "toy" is a plain loop over ElasticCheckpointer; "hf" a Hugging Face
# Trainer (tiny GPT-2 from a config) and "lightning" a Lightning Trainer, each with fleetd's callback.
DEMO_JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "toy": ("agent.examples.train_toy", ()),
    "hf": ("agent.examples.train_hf", ("transformers",)),
    "lightning": ("agent.examples.train_lightning", ()),  # not preloaded: see [job] preload's note
}


def job_group(job: str, steps: int | None = None) -> dict[str, object]:
    entrypoint, preload = DEMO_JOBS[job]
    group: dict[str, object] = {"name": job, "entrypoint": entrypoint, "nproc_per_node": 1}
    if preload:
        group["preload"] = list(preload)
    if steps is not None:
        group["args"] = ["--steps", str(steps)]
    return group


def _toml_value(v: object) -> str:
    # json's string/number/bool/list syntax is valid TOML for these simple values.
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Path):
        return json.dumps(str(v))
    return json.dumps(v)


def to_toml(groups: dict[str, dict[str, object]]) -> str:
    out = []
    for name, values in groups.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        out.append("")
    return "\n".join(out)


@dataclass(frozen=True)
class DemoEndpoints:
    aws_url: str  # what fleetd talks to (the fault proxy in front of moto)
    s3_url: str  # what agents and trainers talk to (moto directly)
    mqtt_url: str
    rdzv_port: int


def fleetd_toml(workdir: Path, ep: DemoEndpoints, nodes: int, budget_usd: float, max_usd_per_hour: float,
                ami_id: str, job: str = "toy") -> Path:
    path = workdir / "fleetd.toml"
    path.write_text(to_toml({
        "aws": {"region": "us-east-1", "endpoint_url": ep.aws_url},
        "fleet": {"name": DEMO_FLEET, "min_nodes": nodes, "max_nodes": nodes + 1,
                  "state_dir": workdir / "state", "reconcile_interval_s": 2.0},
        "capacity": {"instance_types": list(DEMO_TYPES), "zones": list(DEMO_ZONES),
                     "price_book": DEMO_PRICE_BOOK, "spot_wait_s": 20.0, "capacity_error_ttl_s": 60.0,
                     "ami_id": ami_id},
        # A short stop reserve: the demo's checkpoint is small and its nodes are local.
        "scaling": {"initial_nodes": nodes},
        "budget": {"total_usd": budget_usd, "max_usd_per_hour": max_usd_per_hour, "stop_reserve_s": 30.0},
        "mqtt": {"url": ep.mqtt_url},
        "rendezvous": {"host": "127.0.0.1", "port": ep.rdzv_port, "run_id": "demo"},
        "checkpoints": {"bucket": DEMO_BUCKET, "prefix": "checkpoints", "keep": 3, "interval_steps": 50},
        "job": job_group(job),
        "metrics": {"port": 0},
        "logging": {"level": "info", "json": True},
    }))
    return path


def agent_toml(workdir: Path, ep: DemoEndpoints, nodes: int, instance_id: str, addr: str, imds_url: str,
               steps: int, job: str = "toy") -> Path:
    node_dir = workdir / "nodes" / instance_id
    node_dir.mkdir(parents=True, exist_ok=True)
    path = node_dir / "agent.toml"
    path.write_text(to_toml({
        "node": {"fleet": DEMO_FLEET, "imds_url": imds_url, "node_addr": addr, "state_dir": node_dir,
                 "trainer_socket": node_dir / "trainer.sock", "min_nodes": 1, "max_nodes": nodes + 1,
                 "shutdown_timeout_s": 20.0},
        "aws": {"region": "us-east-1", "endpoint_url": ep.s3_url},
        "mqtt": {"url": ep.mqtt_url},
        "rendezvous": {"host": "127.0.0.1", "port": ep.rdzv_port, "run_id": "demo"},
        "checkpoints": {"bucket": DEMO_BUCKET, "prefix": "checkpoints", "keep": 3, "interval_steps": 50,
                        "local_dir": node_dir / "checkpoints"},
        "job": job_group(job, steps),
    }))
    return path
