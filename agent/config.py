"""fleet-agent's configuration: /etc/fleetd/agent.toml plus FLEETD_* environment overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from fleetd.shared.settings import CommonSettings, Group, Name, load_settings

DEFAULT_PATH = Path("/etc/fleetd/agent.toml")


# sockaddr_un.sun_path is 108 bytes on Linux, its terminating NUL included.
MAX_UNIX_SOCKET_PATH = 107


class NodeConfig(Group):
    fleet: Name = "default"
    imds_url: str = "http://169.254.169.254"
    imds_token_ttl_s: Annotated[int, Field(ge=60, le=21600)] = 21600
    imds_timeout_s: Annotated[float, Field(gt=0)] = 1.0
    poll_interval_s: Annotated[float, Field(gt=0, le=1.0)] = 0.5
    telemetry_interval_s: Annotated[float, Field(gt=0)] = 1.0
    # The controller's enrolment endpoint (http://host:8440): the agent trades its signed instance
    # identity document for its MQTT client certificate there (agent/node/enrol.py) and renews it.
    # Empty: use mqtt.cert_file/key_file as configured (or none).
    enrol_url: str = ""
    # Address other nodes reach this one on (torchrun --local-addr); empty: IMDS local-ipv4.
    node_addr: str = ""
    state_dir: Path = Path("/var/lib/fleet-agent")
    # Local channel the trainer reports step/throughput on (a unix datagram socket).
    trainer_socket: Path = Path("/run/fleet-agent/trainer.sock")

    @field_validator("trainer_socket")
    @classmethod
    def _fits_a_unix_socket(cls, path: Path) -> Path:
        # A longer path cannot be bound: the agent would run with no trainer channel, so fleetd
        # would see no step, no throughput and no local checkpoint receipts (found when a test's
        # temporary directory made it 115 bytes).
        if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH:
            raise ValueError(
                f"{len(os.fsencode(path))} bytes; a unix socket path holds at most {MAX_UNIX_SOCKET_PATH}: "
                "choose a shorter one (the default is /run/fleet-agent/trainer.sock)"
            )
        return path

    min_nodes: Annotated[int, Field(ge=1)] = 1
    max_nodes: Annotated[int, Field(ge=1)] = 4
    shutdown_timeout_s: Annotated[float, Field(gt=0)] = 90.0
    # False: no torchrun supervision or emergency path (agent.supervise) on this node; the agent
    # only watches IMDS, reports telemetry and relays the trainer channel (tests, other launchers).
    supervise_training: bool = True
    # Dead man's switch (agent/node/deadman.py): with both the MQTT broker and the rendezvous
    # store unreachable this long, make the newest checkpoint durable in S3 and run
    # shutdown_command, so a dead control host cannot keep spot nodes billing. 0: never.
    controller_lost_after_s: Annotated[float, Field(ge=0)] = 300.0
    # Instance-initiated shutdown terminates a spot instance. The agent runs unprivileged:
    # deploy/polkit lets the fleet-agent user power the machine off.
    shutdown_command: tuple[str, ...] = ("systemctl", "poweroff")
    # After a spot notice (action terminate) has run its course (checkpoint durable, node left),
    # run shutdown_command: an instance-initiated shutdown terminates the spot instance at once
    # instead of at the interruption time, up to two minutes later, billed for nothing. fleetd's
    # launch template turns it on (fleetd/adapters/launch_template.py); off by default so that an
    # agent run by hand or by a test never powers its machine off.
    power_off_after_notice: bool = False


class AgentConfig(CommonSettings):
    node: NodeConfig = NodeConfig()

    @model_validator(mode="after")
    def _no_module_named_agent_beside_the_script(self) -> AgentConfig:
        """fleetd's node package is the top-level ``agent``; the workers import it (the trainer
        library, the warm pool). A job whose script sits beside its own ``agent.py`` or ``agent/``
        would shadow it in the workers (Python puts the script's folder first on sys.path) and fail
        with an ImportError that names neither. Caught here, when the config is read, instead."""
        job = self.job
        if job.module or job.code_uri:  # shipped code is checked when it is packed (fleetd/jobs/pack.py)
            return self
        folder = Path(job.entrypoint).parent
        for clash in (folder / "agent.py", folder / "agent" / "__init__.py", folder / "agent"):
            if clash.exists():
                raise ValueError(
                    f"{clash} would shadow fleetd's own `agent` package in the training workers "
                    "(the script's folder comes first on their import path): rename it"
                )
        return self


def load(path: Path | None = DEFAULT_PATH) -> AgentConfig:
    return load_settings(AgentConfig, path)
