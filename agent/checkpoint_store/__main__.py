"""Operator tool: upload or restore a checkpoint by hand, with the agent's config.

    python -m agent.checkpoint_store upload --job train --step 1200 --writer i-0abc ckpt/step-1200/*
    python -m agent.checkpoint_store restore --job train --dest /tmp/restore
    python -m agent.checkpoint_store list --job train

S3 settings come from the agent config (``--config``, default none) and FLEETD_* environment
variables, e.g. FLEETD_AWS__ENDPOINT_URL, FLEETD_CHECKPOINTS__BUCKET. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from agent.checkpoint_store.errors import StoreError
from agent.checkpoint_store.store import CheckpointStore
from agent.config import AgentConfig
from fleetd.shared.logs import configure_logging
from fleetd.shared.settings import ConfigError, load_settings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent.checkpoint_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, default=None, help="agent TOML config (default: env only)")
    p.add_argument("--job", required=True)
    p.add_argument("--create-bucket", action="store_true", help="create the bucket if missing")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upload", help="upload this writer's files of one step and publish it")
    up.add_argument("--step", type=int, required=True)
    up.add_argument("--writer", required=True)
    up.add_argument(
        "--expected-writer",
        action="append",
        default=None,
        help="every writer of this step (repeat); default: only --writer",
    )
    up.add_argument("--root", type=Path, default=None, help="name files relative to this directory")
    up.add_argument("files", type=Path, nargs="+")
    rs = sub.add_parser("restore", help="restore the newest complete, verified checkpoint")
    rs.add_argument("--dest", type=Path, required=True)
    sub.add_parser("list", help="list complete steps, newest first")
    return p


async def _run(args: argparse.Namespace, cfg: AgentConfig) -> dict[str, Any]:
    async with CheckpointStore.connect(cfg.checkpoints, cfg.aws, job=args.job) as store:
        if args.create_bucket:
            await store.ensure_bucket()
        if args.cmd == "upload":
            r = await store.upload_step(
                args.step,
                args.files,
                writer=args.writer,
                expected_writers=args.expected_writer,
                root=args.root,
            )
            return {
                "step": r.step,
                "complete": r.complete,
                "published": r.published,
                "nbytes": r.nbytes,
                "duration_s": round(r.duration_s, 3),
                "latest_step": r.latest_step,
                "deleted_steps": list(r.deleted_steps),
            }
        if args.cmd == "restore":
            restored = await store.restore_latest(args.dest)
            if restored is None:
                return {"step": None}
            return {
                "step": restored.step,
                "directory": str(restored.directory),
                "nbytes": restored.nbytes,
                "skipped": [list(s) for s in restored.skipped],
            }
        return {"complete_steps": await store.complete_steps()}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging("info", stream=sys.stderr)
    try:
        cfg = load_settings(AgentConfig, args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    try:
        out = asyncio.run(_run(args, cfg))
    except (StoreError, ValueError, OSError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
