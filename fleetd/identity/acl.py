"""The broker's ACL (deploy/mosquitto/acl), and the same with one block per control host when
each host has its own MQTT identity (HA: two controllers with one certificate would take each
other's broker session, since the broker names a session after the certificate's CN)."""

from __future__ import annotations

import re

from fleetd.identity.ca import CONTROLLER_CN

# deploy/mosquitto/acl, verbatim (tests/test_demo_security.py keeps the two equal).
FLEET_ACL = """\
# fleetd broker ACL (mosquitto acl_file). Topics: fleetd/<fleet>/nodes/<instance-id>/<channel>.
# Usernames are TLS certificate Common Names (mosquitto.conf: use_identity_as_username).

# The controller reads everything under fleetd/ and is the only writer of commands and of the
# rendezvous endpoint (HA: the leader publishes its store there, retained; agents follow it, so a
# node able to write it could move every trainer to a store of its choosing).
user fleetd-controller
topic read fleetd/#
topic write fleetd/+/nodes/+/commands
topic write fleetd/+/rendezvous

# HA broker pair (deploy/mosquitto/bridge.conf): the other broker's bridge connects with a
# certificate CN=fleetd-bridge and carries every fleetd/ message both ways.
user fleetd-bridge
topic readwrite fleetd/#

# A read-only monitor (the demo's live view, an operator's dashboard): reads, never writes.
user fleetd-observer
topic read fleetd/#

# Every node: %u is its certificate's CN, i.e. its instance id. It may publish its status (and
# last will), telemetry, events and its workers' logs, and receive its own commands; nothing under any other id.
# The fleet CA issues node certificates with CN=<instance id> only, so a CN can never carry MQTT
# wildcards or a '/' that would widen these patterns (mosquitto also denies usernames with + or #).
pattern write fleetd/+/nodes/%u/status
pattern write fleetd/+/nodes/%u/telemetry
pattern write fleetd/+/nodes/%u/events
pattern write fleetd/+/nodes/%u/logs
pattern read fleetd/+/nodes/%u/commands
# Every node reads the leader's rendezvous endpoint (retained) and nothing else outside its own id.
pattern read fleetd/+/rendezvous
"""

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,40}$")
_CONTROLLER_BLOCK = re.compile(rf"^user {CONTROLLER_CN}\n(?:topic .*\n)+", re.M)


def controller_cn(host: str) -> str:
    """The MQTT identity of the controller on ``host`` (an HA control host's ``ha.host_id``)."""
    if not _HOST.match(host):
        raise ValueError(f"not a usable control host name for a certificate: {host!r}")
    return f"{CONTROLLER_CN}-{host}"


def fleet_acl(controller_hosts: tuple[str, ...] = ()) -> str:
    """The fleet ACL, with the controller's grants repeated for each per-host identity."""
    if not controller_hosts:
        return FLEET_ACL
    m = _CONTROLLER_BLOCK.search(FLEET_ACL)
    assert m is not None, "the ACL lost its controller block"
    grants = m.group(0).split("\n", 1)[1]
    extra = "".join(f"user {controller_cn(h)}\n{grants}\n" for h in controller_hosts)
    return (
        FLEET_ACL[: m.end()]
        + "\n# One identity per control host (fleetd ca init --controller-host).\n"
        + extra
        + FLEET_ACL[m.end() :]
    )
