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
    clients = (CONTROLLER_CN,) + ((OBSERVER_CN,) if args.observer else ()) + ((BRIDGE_CN,) if args.bridge else ())
    args.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    LocalCa.init(args.dir, server_names=tuple(args.broker_name), clients=clients, lifetime=dt.timedelta(days=args.days))
    print(
        f"fleet CA in {args.dir}: ca.crt (give it to the broker and the nodes), ca.key (keep on this host), "
        f"server.crt/key (the broker), {', '.join(f'{c}.crt/key' for c in clients)}"
    )
    return 0
