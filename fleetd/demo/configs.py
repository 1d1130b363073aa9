"""The demo's config files: one fleetd.toml for the controller and one agent.toml per node.

Written as TOML so the demo exercises the same loading path as production (and an operator can
read exactly what the demo ran with in its work directory).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fleetd.adapters.catalog import bundled_catalog
from fleetd.adapters.pricing import DEMO_PRICE_BOOK, FilePriceBook
from fleetd.adapters.pricing_fake import PriceListFake, SpotPriceFake
from fleetd.demo.launcher import poweroff_command
from fleetd.demo.scenario import FleetShape
from fleetd.demo.security import DemoPki

DEMO_FLEET = "demo"
DEMO_BUCKET = "fleetd-demo"
DEMO_TYPES = ("g4dn.xlarge", "g6.xlarge", "g5.xlarge")
DEMO_ZONES = ("us-east-1a", "us-east-1b")
# The demo's training jobs (`fleetd demo --job NAME`). "toy", the default, is a plain loop over
# ElasticCheckpointer shipped as a user's project would be: a job file whose workdir the
# controller packs and the nodes download and set up (TOY_JOB). "hf" (a Hugging Face Trainer, tiny
# GPT-2 from a config) and "lightning" (a Lightning Trainer), each with fleetd's callback, are
# modules in the node's image: the entrypoint and what the node's warm worker pool imports once.
TOY_JOB = Path(__file__).resolve().parents[2] / "agent" / "examples" / "toy_job" / "job.toml"
BAKED_JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hf": ("agent.examples.train_hf", ("transformers",)),
    "lightning": ("agent.examples.train_lightning", ()),  # not preloaded: see [job] preload's note
}
DEMO_JOBS = ("toy", *BAKED_JOBS)
# Periodic saves every ~13 s of the toy at 15 steps/s. They only bound what a loss nobody could
# save would cost: a notice, a drain and a loss without notice each save the step they stop at.
# Every save is a torch.save, an upload from every node and a publish on the store; at 50 steps
# they cost the short demo 16 % of its CPU (99 -> 83 CPU-s measured at 200).
DEMO_CHECKPOINT_INTERVAL_STEPS = 200


def trainer_socket_for(node_dir: Path) -> Path:
    """A demo node's trainer socket: short and unique to the node (a unix socket path holds 107
    bytes, and a node directory under a test's temporary directory alone can be longer)."""
    digest = hashlib.sha256(str(node_dir.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"fleetd-trainer-{digest}.sock"


def toy_job_file(workdir: Path, steps: int | None) -> Path:
    """The toy's job file as the demo submits it: TOY_JOB with the scenario's step count."""
    job = tomllib.loads(TOY_JOB.read_text())
    job["workdir"] = str(TOY_JOB.parent)
    if steps is not None:
        job["run"]["args"] = ["--steps", str(steps)]
    tables = {k: v for k, v in job.items() if isinstance(v, dict)}
    top = [f"{k} = {_toml_value(v)}" for k, v in job.items() if not isinstance(v, dict)]
    path = workdir / "toy-job.toml"
    path.write_text("\n".join(top) + "\n\n" + to_toml(tables))
    return path


def job_group(job: str, steps: int | None = None, workdir: Path | None = None) -> dict[str, object]:
    """The [job] table for a demo job: a job file (the toy's, or a user's path), or a module
    baked into the node's image."""
    if job == "toy":
        assert workdir is not None, "the toy's job file is written into the demo's workdir"
        return {"file": str(toy_job_file(workdir, steps))}
    if job not in BAKED_JOBS:
        return {"file": job}
    entrypoint, preload = BAKED_JOBS[job]
    group: dict[str, object] = {"name": job, "entrypoint": entrypoint, "nproc_per_node": 1}
    if preload:
        group["preload"] = list(preload)
    if steps is not None:
        group["args"] = ["--steps", str(steps)]
    return group


def demo_price_fakes() -> tuple[PriceListFake, SpotPriceFake]:
    """The demo cloud's price APIs, answered by its fault proxy: list prices from the bundled
    catalog (GetProducts), and the demo book's spot prices (DescribeSpotPriceHistory). fleetd
    itself runs on the production price path, with no price book."""
    catalog = bundled_catalog()
    spot = SpotPriceFake(catalog)
    book = FilePriceBook.load(DEMO_PRICE_BOOK)
    for pool in book.pools:
        price = book.price_at(pool, 0.0)
        if price is not None and price.spot is not None:
            spot.set(pool, price.spot)
    return PriceListFake(catalog), spot


def _toml_value(v: object) -> str:
    # json's string/number/bool/list syntax is valid TOML for these simple values.
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Path):
        return json.dumps(str(v))
    if isinstance(v, dict):  # an inline table (e.g. one [[team.regions]] entry)
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
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
    # Secure by default: the fleet PKI (broker TLS + ACL, controller certificate) and the port of
    # fleetd's enrolment endpoint, where nodes get their certificates. None: --insecure.
    pki: DemoPki | None = None
    enrol_port: int = 0


def fleetd_toml(
    workdir: Path,
    ep: DemoEndpoints,
    nodes: int,
    budget_usd: float,
    max_usd_per_hour: float,
    ami_id: str,
    shape: FleetShape | None = None,
    overrides: dict[str, dict[str, object]] | None = None,
    job: str = "toy",
    steps: int | None = None,
    fleet: str = DEMO_FLEET,
) -> Path:
    """``overrides``: extra settings merged into the groups (the partition tests use it). The
    job defined here is the nodes' job: they read it from the launch template's user data.
    ``fleet``: the fleet's name, also its rendezvous run id and checkpoint prefix when it is not
    the demo's own (the team demo runs several fleets side by side)."""
    path = workdir / "fleetd.toml"
    lo, hi, scaling = _fleet_size(nodes, shape)
    groups = _merge(
        {
            "aws": {"region": "us-east-1", "endpoint_url": ep.aws_url},
            "fleet": {
                "name": fleet,
                "min_nodes": lo,
                "max_nodes": hi,
                "state_dir": workdir / "state",
                "reconcile_interval_s": 2.0,
            },
            "capacity": {
                "instance_types": list(DEMO_TYPES),
                "zones": list(DEMO_ZONES),
                "spot_wait_s": 20.0,
                "capacity_error_ttl_s": 60.0,
                "ami_id": ami_id,
            },
            # A short stop reserve: the demo's checkpoint is small and its nodes are local.
            "scaling": scaling,
            "budget": {"total_usd": budget_usd, "max_usd_per_hour": max_usd_per_hour, "stop_reserve_s": 30.0},
            "mqtt": ep.pki.controller_mqtt(ep.mqtt_url) if ep.pki is not None else {"url": ep.mqtt_url},
            **_enrolment(ep),
            "rendezvous": {"host": "127.0.0.1", "port": ep.rdzv_port, "run_id": _run_id(fleet)},
            # The scaling story has no silent loss to detect fast, and its joins restart workers on
            # a busy two-core host: a longer heartbeat timeout keeps a slow beat from reading as a loss.
            **({} if shape is None else {"loss": {"dead_after_s": 20.0}}),
            "checkpoints": {
                "bucket": DEMO_BUCKET,
                "prefix": _prefix(fleet),
                "keep": 3,
                "interval_steps": DEMO_CHECKPOINT_INTERVAL_STEPS,
            },
            "job": job_group(job, steps, workdir),
            "metrics": {"port": 0},
            # Compressed like the demo's notices: a stall is 20 s without a step (production: 180 s).
            # No node replacement: the demo's nodes are local processes on one box, and a fresh node
            # re-imports torch there (on an overloaded box that deepens the stall it should cure).
            # A rendezvous forming a round is not stalled for up to 120 s after the last step.
            "stall": {
                "stall_after_s": 20.0,
                "escalate_after_s": 60.0,
                "replace_nodes": False,
                "reforming_max_s": 120.0,
            },
            "logging": {"level": "info", "json": True},
        },
        overrides or {},
    )
    path.write_text(to_toml(groups))
    return path


def _run_id(fleet: str) -> str:
    return "demo" if fleet == DEMO_FLEET else fleet


def _prefix(fleet: str) -> str:
    return "checkpoints" if fleet == DEMO_FLEET else f"checkpoints/{fleet}"


def _fleet_size(nodes: int, shape: FleetShape | None) -> tuple[int, int, dict[str, object]]:
    """min_nodes, max_nodes and the scaling group."""
    if shape is None:
        # A fixed fleet of --nodes (one more allowed for make-before-break pre-buys). The long
        # cool-down keeps the scaling rule from exploring a bigger fleet inside the demo: the
        # interruption scenarios show recovery, `--scenario scaling` shows scaling.
        return nodes, nodes + 1, {"initial_nodes": nodes, "cooldown_s": 3600.0}
    return shape.min_nodes, shape.max_nodes, {"initial_nodes": shape.initial_nodes, "cooldown_s": shape.cooldown_s}


def _enrolment(ep: DemoEndpoints) -> dict[str, dict[str, object]]:
    """The enrolment group under TLS (the default demo); none on a plain broker."""
    if ep.pki is None:
        return {}
    return {
        "enrol": {
            "enabled": True,
            "host": "127.0.0.1",
            "port": ep.enrol_port,
            "ca_dir": ep.pki.files.directory,
            "identity_certificate": ep.pki.identity_certificate,
        }
    }


def _merge(groups: dict[str, dict[str, object]], extra: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    return {**groups, **{name: {**groups.get(name, {}), **values} for name, values in extra.items()}}


def agent_toml(
    workdir: Path,
    ep: DemoEndpoints,
    max_nodes: int,
    instance_id: str,
    addr: str,
    imds_url: str,
    steps: int,
    control_addr: str = "127.0.0.1",
    job: str = "toy",
    fleet: str = DEMO_FLEET,
) -> Path:
    """``control_addr``: where this node reaches the broker and the rendezvous store. The
    partition tests give each node an address of its own for it (tests/harness/netfault.py)."""
    node_dir = workdir / "nodes" / instance_id
    node_dir.mkdir(parents=True, exist_ok=True)
    path = node_dir / "agent.toml"
    mqtt: dict[str, object] = {"url": ep.mqtt_url.replace("127.0.0.1", control_addr)}
    enrol_url = ""
    if ep.pki is not None:
        # The broker's CA is pinned from config (as an AMI or user data would carry it); the
        # node's own certificate comes from enrolment, over the controller's loopback address.
        mqtt["ca_file"] = ep.pki.files.ca_cert
        enrol_url = f"http://127.0.0.1:{ep.enrol_port}"
    path.write_text(
        to_toml(
            {
                "node": {
                    "fleet": fleet,
                    "imds_url": imds_url,
                    "node_addr": addr,
                    "state_dir": node_dir,
                    "enrol_url": enrol_url,
                    "trainer_socket": trainer_socket_for(node_dir),
                    "min_nodes": 1,
                    "max_nodes": max_nodes,
                    "shutdown_timeout_s": 20.0,
                    "controller_lost_after_s": 90.0,
                    "shutdown_command": poweroff_command(workdir, instance_id),
                },
                "aws": {"region": "us-east-1", "endpoint_url": ep.s3_url},
                "mqtt": mqtt,
                "rendezvous": {"host": control_addr, "port": ep.rdzv_port, "run_id": _run_id(fleet)},
                "checkpoints": {
                    "bucket": DEMO_BUCKET,
                    "prefix": _prefix(fleet),
                    "keep": 3,
                    "interval_steps": DEMO_CHECKPOINT_INTERVAL_STEPS,
                    "local_dir": node_dir / "checkpoints",
                },
                # The image's example job; the user data's (job_env) replaces it, as on EC2.
                **({"job": job_group(job, steps)} if job in BAKED_JOBS else {}),
            }
        )
    )
    return path
