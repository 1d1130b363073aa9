"""`fleetd plan`: what a job would cost on candidate pools, when it would finish, and how likely
it is to miss its deadline, from simulations of fleetd's own policy over many start offsets."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.sim import defaults as d

if TYPE_CHECKING:
    from fleetd.policy.model import PoolId
    from fleetd.sim.whatif import PlanReport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--work-node-hours", type=float, required=True, help="work at one node's pace (GPU-hours on 1-GPU nodes)"
    )
    p.add_argument("--deadline-h", type=float, help="deadline from the start, hours")
    p.add_argument("--budget-usd", type=float, default=1e9, help="budget.total_usd")
    p.add_argument("--nodes", type=int, default=1, help="nodes the job trains on (max_nodes)")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--checkpoint-gb", type=float, default=10.0, help="size of one checkpoint")
    p.add_argument("--checkpoint-stall-s", type=float, default=d.CHECKPOINT_STALL_S.value)
    p.add_argument("--no-notice-share", type=float, default=d.NO_NOTICE_SHARE.value)
    p.add_argument(
        "--pools",
        default="p3.2xlarge@us-east-1a,g5.xlarge@us-east-1a,g4dn.xlarge@us-east-1a",
        help="candidate pools TYPE@ZONE[:SPEED], comma separated; SPEED = throughput relative to "
        "the first pool (default 1)",
    )
    p.add_argument("--spot-price", action="append", default=[], metavar="TYPE=USD", help="override a spot price")
    p.add_argument("--trace-for", action="append", default=[], metavar="POOL=PATH", help="a real trace for a pool")
    p.add_argument("--offsets", type=int, default=200, help="random start offsets per pool (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _parse_pools(text: str) -> list[tuple[PoolId, float]]:
    from fleetd.policy.model import PoolId

    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, speed = item.partition(":")
        out.append((PoolId.parse(name), float(speed) if speed else 1.0))
    if not out:
        raise ValueError("give at least one pool")
    return out


def run(args: argparse.Namespace) -> int:
    from fleetd.policy.model import PoolId
    from fleetd.sim.job import JobSpec
    from fleetd.sim.scenario import Scenario
    from fleetd.sim.traces import TraceError, load_trace
    from fleetd.sim.whatif import plan_job

    try:
        pools = _parse_pools(args.pools)
        spot_over = dict(x.split("=", 1) for x in args.spot_price)
        traces = {}
        for item in args.trace_for:
            pool_text, _, path = item.partition("=")
            traces[PoolId.parse(pool_text)] = load_trace(Path(path))
        if args.nodes < 1 or args.offsets < 1 or args.work_node_hours <= 0:
            raise ValueError("--nodes, --offsets and --work-node-hours must be positive")
        deadline_s = args.deadline_h * 3600 if args.deadline_h else None
        single = deadline_s is not None and args.nodes == 1
        reports = []
        # Pools differ in speed: simulate each with its own throughput, the same work.
        for pool, speed in pools:
            spot, od = (
                d.prices_for(pool.instance_type) if pool.instance_type in d.ON_DEMAND_USD_PER_HOUR else (None, None)
            )
            if pool.instance_type in spot_over:
                spot = float(spot_over[pool.instance_type])
            if spot is None or od is None:
                raise ValueError(
                    f"no price for {pool.instance_type}; known: {', '.join(sorted(d.ON_DEMAND_USD_PER_HOUR))}"
                )
            job = JobSpec(
                total_steps=args.work_node_hours * 3600.0,
                steps_per_node_s=speed,
                min_nodes=min(args.min_nodes, args.nodes),
                max_nodes=args.nodes,
                checkpoint_stall_s=0.0 if single else args.checkpoint_stall_s,
                checkpoint_gb=args.checkpoint_gb,
                deadline_s=deadline_s,
                no_notice_share=0.0 if single else args.no_notice_share,
            )
            placeholder = traces.get(pool) or load_trace("p3")
            base = Scenario(placeholder, job, pool.instance_type, spot, od, budget_usd=args.budget_usd)
            reports.append(
                plan_job(
                    base,
                    [(pool, spot, od)],
                    traces,
                    args.offsets,
                    args.seed,
                    checkpoint_stall_s=args.checkpoint_stall_s,
                )
            )
    except (TraceError, ValueError) as exc:
        print(f"fleetd plan: {exc}", file=sys.stderr)
        return 2
    merged = _merge(reports, args)
    if args.json:
        print(json.dumps(merged, indent=2))
    else:
        print(_table(merged))
    return 0


def _merge(reports: Sequence[PlanReport], args: argparse.Namespace) -> dict[str, Any]:
    """One recommendation across pools (each pool was simulated with its own speed)."""
    from fleetd.sim.whatif import MAX_MISS_RISK, MIX_WITHIN

    pools = [p for r in reports for p in r.to_json()["pools"]]
    eligible = [p for p in pools if p["deadline_miss_risk"] is None or p["deadline_miss_risk"] <= MAX_MISS_RISK]
    notes = list(dict.fromkeys(n for r in reports for n in r.notes if not n.startswith("every pool")))
    if not eligible:
        notes.append(f"every pool misses the deadline more than {MAX_MISS_RISK:.0%} of the time")
        eligible = sorted(pools, key=lambda p: (p["deadline_miss_risk"], p["expected_cost_usd"]))[:1]
    best = min(p["expected_cost_usd"] for p in eligible)
    chosen = [p for p in eligible if p["expected_cost_usd"] <= best * MIX_WITHIN]
    weights = [1.0 / max(p["expected_cost_usd"], 1e-9) for p in chosen]
    mix = [{"pool": p["pool"], "share": round(w / sum(weights), 3)} for p, w in zip(chosen, weights, strict=True)]
    first = {r.pools[0].pool: r for r in reports}
    pick = first[next(iter(k for k in first if str(k) == chosen[0]["pool"]))].to_json()
    od_share = sum(p["on_demand_share"] * m["share"] for p, m in zip(chosen, mix, strict=True))
    return {
        "job": {
            "work_node_hours": args.work_node_hours,
            "nodes": args.nodes,
            "deadline_h": args.deadline_h,
            "budget_usd": args.budget_usd if args.budget_usd < 1e9 else None,
            "checkpoint_gb": args.checkpoint_gb,
            "offsets_per_pool": args.offsets,
        },
        "pools": pools,
        "recommended_mix": mix,
        "on_demand_share": round(od_share, 4),
        "checkpoint_interval_s": pick["checkpoint_interval_s"],
        "checkpoint_interval_without_fleetd_s": pick["checkpoint_interval_without_fleetd_s"],
        "s3": pick["s3"],
        "within_budget": args.budget_usd >= 1e9 or all(p["p90_cost_usd"] <= args.budget_usd for p in chosen),
        "notes": notes,
    }


def _table(m: dict[str, Any]) -> str:
    cols = (
        "pool",
        "interr./node-h",
        "E[cost] $",
        "p90 cost $",
        "on-demand $",
        "finish h (p50/p90)",
        "miss risk",
        "on-demand share",
    )
    rows = [
        (
            p["pool"],
            f"{p['interruptions_per_node_hour']:.5f}",
            f"{p['expected_cost_usd']:,.2f}",
            f"{p['p90_cost_usd']:,.2f}",
            f"{p['on_demand_cost_usd']:,.2f}",
            f"{p['median_finish_h']}/{p['p90_finish_h']}",
            "-" if p["deadline_miss_risk"] is None else f"{100 * p['deadline_miss_risk']:.1f}%",
            f"{100 * p['on_demand_share']:.1f}%",
        )
        for p in m["pools"]
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    s3 = m["s3"]
    out += [
        "",
        "recommended mix: " + ", ".join(f"{x['pool']} {100 * x['share']:.0f}%" for x in m["recommended_mix"]),
        f"on-demand share: {100 * m['on_demand_share']:.1f}% of node-time",
        f"checkpoint interval: {m['checkpoint_interval_s']} s with fleetd (insurance for sharded state and "
        "whole-fleet losses: notices and the survivors' saves cover the rest); "
        f"{m['checkpoint_interval_without_fleetd_s']} s without (Young/Daly sqrt(2 x stall x MTBF))",
        f"S3: {s3['checkpoints']} checkpoints, {s3['put_requests']} PUTs: storage ${s3['storage_usd']:.2f} "
        f"+ requests ${s3['request_usd']:.2f} = ${s3['total_usd']:.2f}",
        f"within budget (p90): {'yes' if m['within_budget'] else 'NO'}",
    ]
    out += [f"note: {n}" for n in m["notes"]]
    out.append("(runs of fleetd's planner over random start offsets; see `fleetd simulate` for the inputs' sources)")
    return "\n".join(out)
