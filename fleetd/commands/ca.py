"""`fleetd ca init`: create the fleet CA (kept if it exists) and (re)issue the broker's server
certificate and the controller's client certificate (CN=fleetd-controller), for
deploy/mosquitto and fleetd.toml [mqtt]/[enrol]. Node certificates are never made here: nodes
enrol at boot (fleetd.toml [enrol])."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ca_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="create the CA; issue the broker's and the controller's certificates")
    init.add_argument(
        "--dir",
        type=Path,
        default=Path("/etc/fleetd/ca"),
        metavar="DIR",
        help="where ca.crt/ca.key (0600), server.*, fleetd-controller.* go (default /etc/fleetd/ca)",
    )
    init.add_argument(
        "--broker-name",
        action="append",
        default=[],
        metavar="NAME",
        help="DNS name or IP the nodes dial the broker by (repeatable; the first is the CN)",
    )
    init.add_argument(
        "--group",
        default=None,
        metavar="GROUP",
        help="the group the controller runs as: it gets read access to the directory, the CA and the "
        "controller's key (default: fleetd, when that group exists; the files are otherwise root's only)",
    )
    init.add_argument(
        "--controller-host",
        action="append",
        default=[],
        metavar="HOST_ID",
        help="also issue fleetd-controller-HOST_ID for an HA control host (repeatable; each host's "
        "ha.host_id): two controllers with one certificate would take each other's broker session",
    )
    init.add_argument("--days", type=int, default=30, help="lifetime of the broker's and controller's certs")
    init.add_argument("--observer", action="store_true", help="also issue a read-only fleetd-observer certificate")
    init.add_argument(
        "--bridge",
        action="store_true",
        help="also issue fleetd-bridge, the HA broker pair's bridge certificate (deploy/mosquitto/bridge.conf)",
    )


def run(args: argparse.Namespace) -> int:
    import datetime as dt

    from fleetd.identity.ca import BRIDGE_CN, CONTROLLER_CN, OBSERVER_CN, LocalCa

    if not args.broker_name:
        print("fleetd ca init: give at least one --broker-name (the name nodes connect to)", file=sys.stderr)
        return 2
    if args.days < 1:
        print("fleetd ca init: --days must be >= 1", file=sys.stderr)
        return 2
    from fleetd.identity.acl import controller_cn, fleet_acl

    try:
        hosts = tuple(dict.fromkeys(args.controller_host))
        per_host = tuple(controller_cn(h) for h in hosts)
    except ValueError as exc:
        print(f"fleetd ca init: {exc}", file=sys.stderr)
        return 2
    clients = (
        (CONTROLLER_CN, *per_host) + ((OBSERVER_CN,) if args.observer else ()) + ((BRIDGE_CN,) if args.bridge else ())
    )
    args.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    LocalCa.init(args.dir, server_names=tuple(args.broker_name), clients=clients, lifetime=dt.timedelta(days=args.days))
    # The broker's ACL for exactly these identities (deploy/mosquitto/acl plus one block per host).
    (args.dir / "acl").write_text(fleet_acl(hosts))
    group = args.group if args.group is not None else ("fleetd" if _group_exists("fleetd") else None)
    if group is not None:
        try:
            share_with_group(args.dir, group, clients)
        except (KeyError, PermissionError) as exc:
            print(f"fleetd ca init: cannot give group {group!r} access: {exc}", file=sys.stderr)
            return 1
        print(
            f"{args.dir}: readable by group {group} (the CA and {CONTROLLER_CN}'s key: fleetd.service signs and connects)"
        )
    else:
        print(
            f"{args.dir}: no fleetd group on this host, so the files are root's only; run `fleetd ca init "
            "--group <the controller's group>` once the service user exists (deploy/README.md)",
            file=sys.stderr,
        )
    print(
        f"fleet CA in {args.dir}: ca.crt (give it to the broker and the nodes), ca.key (keep on this host), "
        f"server.crt/key and acl (the broker), {', '.join(f'{c}.crt/key' for c in clients)}"
    )
    return 0


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def share_with_group(directory: Path, group: str, clients: tuple[str, ...]) -> None:
    """fleetd.service runs as its own user: the enrolment endpoint signs with ca.key and the
    controller connects with its certificate. Those files become group-readable (0640) in a
    0750 directory; the broker's key stays root's (it is installed for mosquitto separately)."""
    import grp
    import os

    gid = grp.getgrnam(group).gr_gid
    os.chown(directory, -1, gid)
    directory.chmod(0o750)
    names = ["ca.key", "ca.crt", *(f"{cn}.{ext}" for cn in clients for ext in ("key", "crt"))]
    for name in names:
        path = directory / name
        if path.exists():
            os.chown(path, -1, gid)
            path.chmod(0o640)
