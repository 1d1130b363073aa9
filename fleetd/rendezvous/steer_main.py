"""The steering loop standalone, for tests and the local cluster (fleetd runs ``Steerer`` in its
own TaskGroup): ``python -m fleetd.rendezvous.steer_main --host H --port P --run-id R``."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from fleetd.rendezvous.client import RendezvousClient
from fleetd.rendezvous.steer_settings import SteerSettings
from fleetd.rendezvous.steering import Steerer


async def _main(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = RendezvousClient(args.host, args.port, args.run_id)  # connected by run()
    settings = SteerSettings(
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        dead_after_s=args.dead_after_s,
        hang_after_s=args.hang_after_s,
    )
    await Steerer(client, settings).run(stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    from fleetd.shared.logs import bind_context, configure_logging

    p = argparse.ArgumentParser(description="steer a torchrun c10d rendezvous (fleetd's loop, standalone)")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--max-nodes", type=int, default=1 << 30)
    p.add_argument("--dead-after-s", type=float, default=6.0)
    p.add_argument("--hang-after-s", type=float, default=10.0)
    args = p.parse_args(argv)
    configure_logging("info", json=True, stream=sys.stderr)
    bind_context(component="steering", run_id=args.run_id)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
