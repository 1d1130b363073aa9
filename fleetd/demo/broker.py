"""A local MQTT broker for the demo: mosquitto if installed, else amqtt (pure Python).

fleetd's handlers never rely on the broker's topic filtering (amqtt is known to deliver stray
retained messages), so either broker is fine for the demo.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fleetd.demo.procs import Child
from fleetd.localnet import free_port, wait_port_async as wait_port


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.path.exists(p)), None
    )


def mosquitto_config(port: int, log: Path, host: str = "127.0.0.1") -> str:
    lines = [
        f"listener {port} {host}",
        "allow_anonymous true",
        "persistence false",
        f"log_dest file {log}",
        "log_type error",
        "log_type warning",
    ]
    if os.geteuid() == 0:
        lines.append("user root")  # otherwise mosquitto drops to 'mosquitto' and cannot write the log
    return "\n".join(lines) + "\n"


def amqtt_config(port: int, host: str = "127.0.0.1") -> str:
    return (
        "listeners:\n  default:\n    type: tcp\n"
        f"    bind: {host}:{port}\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
    )


async def start_broker(workdir: Path) -> tuple[Child, str, str]:
    """Start a broker; returns (child, url, kind)."""
    port = free_port()
    exe = find_mosquitto()
    if exe is not None:
        conf = workdir / "mosquitto.conf"
        conf.write_text(mosquitto_config(port, workdir / "mosquitto.log"))
        child = await Child.start("mosquitto", [exe, "-c", str(conf)], workdir / "mosquitto.out")
        kind = "mosquitto"
    else:
        conf = workdir / "amqtt.yaml"
        conf.write_text(amqtt_config(port))
        amqtt = shutil.which("amqtt") or "amqtt"
        child = await Child.start("amqtt", [amqtt, "-c", str(conf)], workdir / "amqtt.log")
        kind = "amqtt"
    await wait_port("127.0.0.1", port)
    return child, f"mqtt://127.0.0.1:{port}", kind
