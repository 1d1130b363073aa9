"""The launch template fleetd's nodes boot from: create it once, or use the one the config names.

The template pins what every node must have: the agent AMI, the instance profile, the security
groups, IMDSv2 required with a hop limit of 1 (containers on the node cannot reach IMDS
credentials), and user data that points the agent at this controller.
"""

from __future__ import annotations

import base64
import json
import shlex
from dataclasses import dataclass
from typing import Any

from fleetd.adapters.aws_errors import PermanentAwsError, aws_call
from fleetd.config import FleetdConfig
from fleetd.shared.logs import get_logger
from fleetd.shared.settings import JobConfig

log = get_logger(__name__)

# Read by the fleet-agent unit (EnvironmentFile=-/etc/fleetd/agent.env); FLEETD_* overrides the
# agent's TOML file, so the AMI stays generic and the fleet-specific bits arrive at boot.
AGENT_ENV_FILE = "/etc/fleetd/agent.env"
NODE_CA_FILE = "/etc/fleetd/mqtt/ca.crt"


def enrol_url(cfg: FleetdConfig) -> str:
    """The enrolment endpoint as nodes reach it: ``enrol.public_url``, else this control host's
    advertised address (the one nodes reach the rendezvous store on)."""
    if cfg.enrol.public_url:
        return cfg.enrol.public_url
    host = cfg.ha.advertise_host or cfg.rendezvous.host
    return f"http://{host}:{cfg.enrol.port}/v1/enrol"


def _ca_lines(cfg: FleetdConfig) -> list[str]:
    if not cfg.enrol.enabled:
        return []
    try:
        pem = (cfg.enrol.ca_dir / "ca.crt").read_text()
    except OSError as exc:
        raise PermanentAwsError(
            "CreateLaunchTemplate",
            "MissingFleetCa",
            f"the fleet CA certificate {cfg.enrol.ca_dir / 'ca.crt'} is not readable ({exc}): nodes would not "
            "know which broker to trust; run `fleetd ca init` (deploy/README.md)",
        ) from exc
    return [
        "install -d -m 0750 -g fleet-agent /etc/fleetd/mqtt",
        f"cat > {NODE_CA_FILE} <<'FLEETD_CA'",
        *pem.strip().splitlines(),
        "FLEETD_CA",
        f"chmod 0644 {NODE_CA_FILE}",
    ]


@dataclass(frozen=True, slots=True)
class TemplateRef:
    """What CreateFleet's LaunchTemplateSpecification needs."""

    template_id: str
    version: str  # a version number, or "$Default"

    def spec(self) -> dict[str, str]:
        return {"LaunchTemplateId": self.template_id, "Version": self.version}


def job_env(job: JobConfig) -> dict[str, str]:
    """The job as the controller defines it, as the agent's FLEETD_JOB__* environment: the
    image's baked agent.toml is only an example. Whole in every node's user data, with the code
    version it runs (fleetd/protocol/job_code.py). The demo's nodes read it from the same place."""
    env = {
        "FLEETD_JOB__NAME": job.name,
        "FLEETD_JOB__ENTRYPOINT": job.entrypoint,
        "FLEETD_JOB__MODULE": json.dumps(job.module),
        "FLEETD_JOB__ARGS": json.dumps(list(job.args)),
        "FLEETD_JOB__NPROC_PER_NODE": str(job.nproc_per_node),
        "FLEETD_JOB__PRELOAD": json.dumps(list(job.preload)),
        "FLEETD_JOB__CHECKPOINT_SIGNAL": job.checkpoint_signal,
        "FLEETD_JOB__SETUP": json.dumps(list(job.setup)),
        "FLEETD_JOB__ENV": json.dumps(job.env),
        "FLEETD_JOB__CODE_URI": job.code_uri,
        "FLEETD_JOB__CODE_DIGEST": job.code_digest,
    }
    if job.checkpoint_dir:
        env["FLEETD_JOB__CHECKPOINT_DIR"] = str(job.checkpoint_dir)
        env["FLEETD_JOB__CHECKPOINT_SETTLE_S"] = f"{job.checkpoint_settle_s:g}"
    return env


def parse_user_data_env(user_data: str) -> dict[str, str]:
    """The FLEETD_* settings ``agent_user_data`` wrote (the inverse of its env file lines)."""
    out: dict[str, str] = {}
    lines = user_data.splitlines()
    if f"cat > {AGENT_ENV_FILE} <<'FLEETD_ENV'" not in lines:
        return out
    for line in lines[lines.index(f"cat > {AGENT_ENV_FILE} <<'FLEETD_ENV'") + 1 :]:
        if line == "FLEETD_ENV":
            break
        key, _, value = line.partition("=")
        (parsed,) = shlex.split(value) or [""]
        out[key] = parsed
    return out


def agent_user_data(cfg: FleetdConfig) -> str:
    """A boot script that hands the agent its fleet-specific settings, then (re)starts it.

    Secrets (the MQTT password) are deliberately absent: user data is readable by anything that
    can reach IMDS on the node; the AMI/instance profile provide credentials instead.
    """
    env = {
        "FLEETD_NODE__FLEET": cfg.fleet.name,
        "FLEETD_NODE__MIN_NODES": str(max(cfg.fleet.min_nodes, 1)),
        "FLEETD_NODE__MAX_NODES": str(cfg.fleet.max_nodes),
        # A node that has left on a spot notice (step durable) shuts itself down: the instance
        # stops billing then, not at the interruption time (agent/config.py).
        "FLEETD_NODE__POWER_OFF_AFTER_NOTICE": "true",
        # The image's own agent.toml trains nothing until its user data names the job.
        "FLEETD_NODE__SUPERVISE_TRAINING": "true",
        "FLEETD_AWS__REGION": cfg.aws.region,
        "FLEETD_MQTT__URL": cfg.mqtt.url,
        "FLEETD_RENDEZVOUS__HOST": cfg.rendezvous.host,
        "FLEETD_RENDEZVOUS__PORT": str(cfg.rendezvous.port),
        "FLEETD_RENDEZVOUS__RUN_ID": cfg.rendezvous.run_id,
        "FLEETD_CHECKPOINTS__BUCKET": cfg.checkpoints.bucket,
        "FLEETD_CHECKPOINTS__PREFIX": cfg.checkpoints.prefix,
        **job_env(cfg.job),
    }
    if cfg.enrol.enabled:
        # Where the node gets its certificate, and the CA it pins the broker with (public: the
        # CA certificate, never a key). Without them the baked example config enrols nowhere.
        env["FLEETD_NODE__ENROL_URL"] = enrol_url(cfg)
        env["FLEETD_MQTT__CA_FILE"] = NODE_CA_FILE
    lines = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(
        [
            "#!/bin/bash",
            "set -euo pipefail",
            "install -d -m 0755 /etc/fleetd",
            f"cat > {AGENT_ENV_FILE} <<'FLEETD_ENV'",
            *lines,
            "FLEETD_ENV",
            *_ca_lines(cfg),
            "systemctl daemon-reload",
            "systemctl enable --now fleet-agent.service",
            "systemctl restart fleet-agent.service",
            "",
        ]
    )


def template_data(cfg: FleetdConfig) -> dict[str, Any]:
    cap = cfg.capacity
    if not cap.ami_id:
        raise PermanentAwsError(
            "CreateLaunchTemplate",
            "MissingAmi",
            "capacity.ami_id is required when fleetd creates the launch template "
            "(or name an existing one in capacity.launch_template)",
        )
    data: dict[str, Any] = {
        "ImageId": cap.ami_id,
        "UserData": base64.b64encode(agent_user_data(cfg).encode()).decode(),
        "MetadataOptions": {
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 1,
            "HttpEndpoint": "enabled",
        },
        "InstanceInitiatedShutdownBehavior": "terminate",
    }
    if cap.instance_profile_arn:
        data["IamInstanceProfile"] = {"Arn": cap.instance_profile_arn}
    if cap.security_group_ids:
        data["SecurityGroupIds"] = list(cap.security_group_ids)
    return data


def default_template_name(cfg: FleetdConfig) -> str:
    return f"fleetd-{cfg.fleet.name}"


async def ensure_launch_template(client: Any, cfg: FleetdConfig) -> TemplateRef:
    """Use the configured template (at its default version: the operator's), or fleetd's own,
    created once. fleetd's own is kept current: when the AMI, the user data or anything else it
    pins changed since its newest version (a new image, a new controller address), a new version
    is written, and launches name that version explicitly: "$Default" would keep booting new nodes
    from the first one."""
    named = cfg.capacity.launch_template
    name = named or default_template_name(cfg)
    existing = await _find(client, name)
    if existing is not None and named:
        log.info("launch_template_reused", name=name, template_id=existing, managed=False)
        return TemplateRef(existing, "$Default")
    if named:
        raise PermanentAwsError(
            "DescribeLaunchTemplates", "LaunchTemplateNotFound", f"launch template {named!r} does not exist"
        )
    data = template_data(cfg)
    if existing is not None:
        version, current = await _latest(client, existing)
        if _same(current, data):
            log.info("launch_template_reused", name=name, template_id=existing, version=version, managed=True)
            return TemplateRef(existing, str(version))
        async with aws_call("CreateLaunchTemplateVersion"):
            resp = await client.create_launch_template_version(
                LaunchTemplateId=existing,
                LaunchTemplateData=data,
                VersionDescription="fleetd: the AMI, user data or node settings changed",
            )
        new = int(resp["LaunchTemplateVersion"]["VersionNumber"])
        changed = sorted(k for k in set(data) | set(current) if data.get(k) != current.get(k))
        log.warning("launch_template_updated", name=name, template_id=existing, version=new, changed=changed)
        return TemplateRef(existing, str(new))
    async with aws_call("CreateLaunchTemplate"):
        resp = await client.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData=data,
            TagSpecifications=[
                {"ResourceType": "launch-template", "Tags": [{"Key": "fleetd:fleet", "Value": cfg.fleet.name}]}
            ],
        )
    template_id = resp["LaunchTemplate"]["LaunchTemplateId"]
    version = int(resp["LaunchTemplate"].get("LatestVersionNumber", 1))
    log.info("launch_template_created", name=name, template_id=template_id, version=version)
    return TemplateRef(template_id, str(version))


async def _latest(client: Any, template_id: str) -> tuple[int, dict[str, Any]]:
    async with aws_call("DescribeLaunchTemplateVersions"):
        resp = await client.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=["$Latest"])
    (found,) = resp["LaunchTemplateVersions"]
    return int(found["VersionNumber"]), dict(found.get("LaunchTemplateData", {}))


def _same(current: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Compares what fleetd sets (EC2 may add defaults of its own to a version's data)."""
    return all(current.get(k) == v for k, v in wanted.items())


async def _find(client: Any, name: str) -> str | None:
    try:
        async with aws_call("DescribeLaunchTemplates"):
            resp = await client.describe_launch_templates(LaunchTemplateNames=[name])
    except PermanentAwsError as exc:
        if "NotFound" in exc.code or "NotFoundException" in exc.code:
            return None
        raise
    templates = resp.get("LaunchTemplates", [])
    return templates[0]["LaunchTemplateId"] if templates else None
