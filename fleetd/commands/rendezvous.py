"""`fleetd rendezvous`: host the job's c10d rendezvous store in its own long-lived process."""

from __future__ import annotations

import argparse
import sys

from fleetd.commands.common import add_config_argument
from fleetd.config import DEFAULT_PATH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, DEFAULT_PATH)


def run(args: argparse.Namespace) -> int:
    from fleetd.config import load
    from fleetd.rendezvous.host import HostSpec, run_until_signalled
    from fleetd.shared.logs import bind_context, configure_logging
    from fleetd.shared.settings import ConfigError
    from fleetd.shared.torch_support import untested_torch

    if (why := untested_torch()) is not None:
        print(f"fleetd rendezvous: {why}", file=sys.stderr)
        return 2
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    configure_logging(cfg.logging.level, json=cfg.logging.json_lines)
    bind_context(fleet=cfg.fleet.name, component="rendezvous-host", run_id=cfg.rendezvous.run_id)
    return run_until_signalled(HostSpec(cfg.rendezvous.host, cfg.rendezvous.port))
