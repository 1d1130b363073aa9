"""The launch template fleetd's nodes boot from: create it once, or use the one the config names.

The template pins what every node must have: the agent AMI, the instance profile, the security
groups, IMDSv2 required with a hop limit of 1 (containers on the node cannot reach IMDS
credentials), and user data that points the agent at this controller.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass
from typing import Any

from fleetd.adapters.aws_errors import PermanentAwsError, aws_call
from fleetd.config import FleetdConfig
from fleetd.protocol.logs import get_logger

log = get_logger(__name__)

# Read by the fleet-agent unit (EnvironmentFile=-/etc/fleetd/agent.env); FLEETD_* overrides the
# agent's TOML file, so the AMI stays generic and the fleet-specific bits arrive at boot.
AGENT_ENV_FILE = "/etc/fleetd/agent.env"


@dataclass(frozen=True, slots=True)
class TemplateRef:
    """What CreateFleet's LaunchTemplateSpecification needs."""

    template_id: str
    version: str  # a version number, or "$Default"

    def spec(self) -> dict[str, str]:
        return {"LaunchTemplateId": self.template_id, "Version": self.version}


def agent_user_data(cfg: FleetdConfig) -> str:
    """A boot script that hands the agent its fleet-specific settings, then (re)starts it.

    Secrets (the MQTT password) are deliberately absent: user data is readable by anything that
    can reach IMDS on the node; the AMI/instance profile provide credentials instead.
    """
    env = {
        "FLEETD_NODE__FLEET": cfg.fleet.name,
        "FLEETD_NODE__MIN_NODES": str(max(cfg.fleet.min_nodes, 1)),
        "FLEETD_NODE__MAX_NODES": str(cfg.fleet.max_nodes),
        "FLEETD_AWS__REGION": cfg.aws.region,
        "FLEETD_MQTT__URL": cfg.mqtt.url,
        "FLEETD_RENDEZVOUS__HOST": cfg.rendezvous.host,
        "FLEETD_RENDEZVOUS__PORT": str(cfg.rendezvous.port),
        "FLEETD_RENDEZVOUS__RUN_ID": cfg.rendezvous.run_id,
        "FLEETD_CHECKPOINTS__BUCKET": cfg.checkpoints.bucket,
        "FLEETD_CHECKPOINTS__PREFIX": cfg.checkpoints.prefix,
        "FLEETD_JOB__NAME": cfg.job.name,
    }
    lines = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(
        [
            "#!/bin/bash",
            "set -euo pipefail",
            "install -d -m 0755 /etc/fleetd",
            f"cat > {AGENT_ENV_FILE} <<'FLEETD_ENV'",
            *lines,
            "FLEETD_ENV",
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
    """Use the configured template, or create fleetd's own once and reuse it afterwards."""
    named = cfg.capacity.launch_template
    name = named or default_template_name(cfg)
    existing = await _find(client, name)
    if existing is not None:
        log.info("launch_template_reused", name=name, template_id=existing, managed=named is None)
        return TemplateRef(existing, "$Default")
    if named:
        raise PermanentAwsError(
            "DescribeLaunchTemplates", "LaunchTemplateNotFound", f"launch template {named!r} does not exist"
        )
    async with aws_call("CreateLaunchTemplate"):
        resp = await client.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData=template_data(cfg),
            TagSpecifications=[
                {"ResourceType": "launch-template", "Tags": [{"Key": "fleetd:fleet", "Value": cfg.fleet.name}]}
            ],
        )
    template_id = resp["LaunchTemplate"]["LaunchTemplateId"]
    log.info("launch_template_created", name=name, template_id=template_id)
    return TemplateRef(template_id, "$Default")


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
