"""`fleet-agent` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent import __version__
from agent.config import DEFAULT_PATH, AgentConfig


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_PATH,
        metavar="PATH",
        help=f"TOML config file (default: {DEFAULT_PATH}); FLEETD_* environment variables override it",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-agent",
        description="fleetd's on-node agent: IMDS watcher, telemetry, torchrun supervisor, checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"fleet-agent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run the agent (systemd service on every node)")
    _add_config(run)
    config = sub.add_parser("config", help="configuration tools (config check)")
    csub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = csub.add_parser(
        "check",
        help="validate the config; print it with secrets redacted (exit 0) or each error (exit 2)",
    )
    _add_config(check)
    return parser


def _run(path: Path) -> int:
    import asyncio

    from agent.config import load
    from agent.main import run_agent
    from fleetd.shared.logs import configure_logging
    from fleetd.shared.settings import ConfigError

    try:
        # The default path may not exist on a dev box: then environment and defaults only.
        config = load(path if path != DEFAULT_PATH or path.exists() else None)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    configure_logging(config.logging.level, json=config.logging.json_lines)
    asyncio.run(run_agent(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("config", "run"):
        # An image built with an untested torch fails here: at its build's `config check`, and
        # loudly at boot (fleetd then ends the node as a broken boot), not mid-job.
        from fleetd.shared.torch_support import untested_torch

        if (why := untested_torch()) is not None:
            print(f"fleet-agent: {why}", file=sys.stderr)
            return 2
    if args.command == "config":
        from fleetd.shared.settings import config_check

        return config_check(AgentConfig, args.config)
    if args.command == "run":
        return _run(args.config)
    return 2


if __name__ == "__main__":
    sys.exit(main())
