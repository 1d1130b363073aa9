"""Command-line options shared by `fleetd simulate` and `fleetd plan`, and the scenario they build.

Every option's default is a `defaults.Sourced` value or derived from the trace, and the sources
are listed by `sources()` so the table output can show what the numbers rest on.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fleetd.sim import defaults as d
from fleetd.sim.job import JobSpec
from fleetd.sim.scenario import Scenario, ideal_steps
from fleetd.sim.traces import Trace, ValueMeaning

DEFAULT_WORK_SHARE = 0.8  # cluster jobs: 80 % of what a perfect elastic job could do on the trace
# Deadline jobs without a work size: Can't Be Late's tight setting, 48 h of work by 52 h.
DEFAULT_DEADLINE_WORK_SHARE = 48.0 / 52.0


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace-values",
        choices=[m.value for m in ValueMeaning],
        default=ValueMeaning.AVAILABLE.value,
        help="meaning of the values of a per-tick JSON trace: 0/1 availability (default), node count, or 1 = preempted",
    )
    p.add_argument("--start-offset-h", type=float, default=0.0, help="start the job this far into the trace")


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--work-steps", type=float, help="total work in steps")
    g.add_argument(
        "--work-node-hours",
        type=float,
        help="total work in node-hours at one node's pace (GPU-hours for 1-GPU nodes)",
    )
    g.add_argument("--steps-per-node-s", type=float, default=1.0, help="one node's throughput (default 1)")
    g.add_argument(
        "--scaling-efficiency",
        type=float,
        default=d.SCALING_EFFICIENCY_PER_DOUBLING.value,
        help="share of per-node throughput kept per doubling of nodes (default %(default)s)",
    )
    g.add_argument("--min-nodes", type=int, default=1)
    g.add_argument("--max-nodes", type=int, help="default: the trace's most live nodes")
    g.add_argument("--deadline-h", type=float, help="deadline from the job's start, in hours")
    g.add_argument("--checkpoint-stall-s", type=float, default=d.CHECKPOINT_STALL_S.value)
    g.add_argument("--checkpoint-gb", type=float, default=10.0, help="checkpoint size (S3 cost)")
    g.add_argument(
        "--periodic-checkpoint-s",
        type=float,
        help="baselines' checkpoint period (default: Young/Daly for the trace's event rate)",
    )
    g.add_argument("--notice-lead-s", type=float, default=d.NOTICE_LEAD_S.value)
    g.add_argument("--no-notice-share", type=float, default=d.NO_NOTICE_SHARE.value)
    r = p.add_argument_group("recovery")
    r.add_argument("--reform-s", type=float, default=None, help="fleetd's re-form time after a leave")
    r.add_argument("--join-reform-s", type=float, default=None, help="fleetd's re-form time for a join")
    r.add_argument("--torchrun-reform-s", type=float, default=None, help="torchrun's re-form time")
    r.add_argument("--restart-recovery-s", type=float, default=d.CHECKPOINT_RESTART_RECOVERY_S.value)
    r.add_argument(
        "--changeover-h",
        type=float,
        default=d.CHANGEOVER_S.value / 3600,
        help="deadline jobs: buying a node until it trains (d), the same for every policy",
    )
    m = p.add_argument_group("prices and budget")
    m.add_argument("--instance-type", help="default: from the trace's name")
    m.add_argument("--spot-price", type=float, help="USD/h (default: price table)")
    m.add_argument("--on-demand-price", type=float, help="USD/h (default: price table)")
    m.add_argument("--budget-usd", type=float, default=1e9, help="fleetd's budget.total_usd")
    m.add_argument("--max-usd-per-hour", type=float, default=1e6, help="fleetd's budget.max_usd_per_hour")
    m.add_argument(
        "--on-demand",
        choices=("never", "deadline", "hold_size"),
        default="deadline",
        help="fleetd's capacity.on_demand (default %(default)s: only when a deadline asks for it)",
    )
    m.add_argument("--no-on-demand", action="store_true", help='fleetd: capacity.on_demand = "never"')
    m.add_argument(
        "--no-leaving-signal",
        action="store_true",
        help="fleetd: model agents that never report that a drained node left (it stays billed "
        "until AWS reclaims it or the drain times out); by default the trainer-exited report "
        "ends it at once (DESIGN.md step 4)",
    )
    m.add_argument(
        "--sharded-state",
        action="store_true",
        help="fleetd: the job's state is sharded (FSDP/ZeRO), so after a loss without notice the "
        "survivors cannot save the step they completed and the job rolls back to its last "
        "checkpoint; by default data-parallel replicas save it (agent/trainer/salvage.py)",
    )
    p.add_argument(
        "--capacity-signal",
        choices=("probe", "instant"),
        default="probe",
        help="how every policy learns that spot capacity returned: probe (default; by a launch "
        "attempt, a short one retried after fleetd's capacity-error TTL, as on EC2) or instant "
        "(an oracle no real tool has; a sensitivity setting)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for which losses come without notice")
    p.add_argument(
        "--config",
        type=Path,
        help="a fleetd config whose planner settings fleetd's policy uses (fleet size, instance "
        "type, on-demand permission and budget still come from the options above)",
    )


def build_scenario(args: argparse.Namespace, trace: Trace) -> Scenario:
    """The scenario the options describe; raises ValueError with a readable message."""
    from fleetd.sim.defaults import instance_type_for_trace, prices_for

    sources: dict[str, str] = {}
    if args.instance_type:
        itype = args.instance_type
    else:
        itype, why = instance_type_for_trace(trace.name)
        sources["instance type"] = f"{itype} ({why})"
    if args.spot_price is None or args.on_demand_price is None:
        spot, od = prices_for(itype)
        sources["prices"] = d.PRICE_SOURCE
    spot = args.spot_price if args.spot_price is not None else spot
    od = args.on_demand_price if args.on_demand_price is not None else od
    max_nodes = args.max_nodes or max(1, trace.max_live)
    deadline_s = args.deadline_h * 3600 if args.deadline_h else None
    deadline_mode = deadline_s is not None
    base = JobSpec(
        total_steps=1.0,
        steps_per_node_s=args.steps_per_node_s,
        scaling_efficiency_per_doubling=args.scaling_efficiency,
        min_nodes=min(args.min_nodes, max_nodes),
        max_nodes=max_nodes,
        # Can't Be Late's model: progress survives a loss, the overhead d covers the restore.
        checkpoint_stall_s=0.0 if deadline_mode else args.checkpoint_stall_s,
        checkpoint_gb=args.checkpoint_gb,
        deadline_s=deadline_s,
        notice_lead_s=args.notice_lead_s,
        no_notice_share=0.0 if deadline_mode else args.no_notice_share,
    )
    job = base.with_(total_steps=_work_steps(args, trace, base, max_nodes, sources))
    base_config = _planner_config(args, sources)
    measured = d.measured_overrides()
    reform = args.reform_s
    if reform is None:
        reform = measured.get("reform_s", d.FLEETD_REFORM_S).value
    join_reform = args.join_reform_s
    if join_reform is None:
        join_reform = measured.get("join_reform_s", d.FLEETD_JOIN_REFORM_S).value
    torchrun_reform = args.torchrun_reform_s
    if torchrun_reform is None:
        torchrun_reform = measured.get("torchrun_reform_s", d.TORCHRUN_REFORM_S).value
    return Scenario(
        trace=trace,
        job=job,
        instance_type=itype,
        spot_price=spot,
        on_demand_price=od,
        budget_usd=args.budget_usd,
        max_usd_per_hour=args.max_usd_per_hour,
        on_demand="never" if args.no_on_demand else args.on_demand,
        leaving_signal=not args.no_leaving_signal,
        salvage_loss_s=None if args.sharded_state else d.SALVAGE_STEP_LOSS_S.value,
        base_config=base_config,
        reform_s=reform,
        join_reform_s=join_reform,
        torchrun_reform_s=torchrun_reform,
        restart_recovery_s=args.restart_recovery_s,
        changeover_s=args.changeover_h * 3600,
        periodic_checkpoint_s=args.periodic_checkpoint_s,
        capacity_signal=args.capacity_signal,
        seed=args.seed,
        sources=sources,
    )


def _work_steps(
    args: argparse.Namespace, trace: Trace, base: JobSpec, max_nodes: int, sources: dict[str, str]
) -> float:
    """The job's size: as given (steps or node-hours), else a default that says where it came from."""
    if args.work_steps:
        return float(args.work_steps)
    if args.work_node_hours:
        return float(args.work_node_hours * 3600 * args.steps_per_node_s)
    if base.deadline_s is not None:
        sources["work"] = "48/52 of the deadline at the full fleet size (Can't Be Late's tight setting)"
        return DEFAULT_DEADLINE_WORK_SHARE * base.deadline_s * base.throughput(max_nodes)
    sources["work"] = "80 % of what a perfect elastic job could do on this trace"
    return DEFAULT_WORK_SHARE * ideal_steps(trace, base)


def _planner_config(args: argparse.Namespace, sources: dict[str, str]) -> Any:
    """The planner settings from --config (None: the defaults); raises ValueError, field by field."""
    if args.config is None:
        return None
    from fleetd.config import load
    from fleetd.shared.settings import ConfigError

    try:
        cfg = load(args.config)
    except ConfigError as exc:
        raise ValueError(exc.render()) from None
    sources["planner settings"] = str(args.config)
    return cfg


def sources(scenario: Scenario) -> list[tuple[str, str]]:
    """(figure, where it comes from) for the table output."""
    job = scenario.job
    rows = [(k, v) for k, v in scenario.sources.items()]
    measured = d.measured_overrides()
    rows += [
        (f"fleetd re-form {scenario.reform_s:g} s", measured.get("reform_s", d.FLEETD_REFORM_S).source),
        (
            f"fleetd join {scenario.join_reform_s:g} s",
            measured.get("join_reform_s", d.FLEETD_JOIN_REFORM_S).source,
        ),
        (
            f"torchrun re-form {scenario.torchrun_reform_s:g} s",
            measured.get("torchrun_reform_s", d.TORCHRUN_REFORM_S).source,
        ),
        (f"checkpoint stall {job.checkpoint_stall_s:g} s", d.CHECKPOINT_STALL_S.source),
        (f"notice lead {job.notice_lead_s:g} s", d.NOTICE_LEAD_S.source),
        (f"losses without notice {job.no_notice_share:.0%}", d.NO_NOTICE_SHARE.source),
        (f"fleetd loss detection {d.FLEETD_LOSS_DETECT_S.value:g} s", d.FLEETD_LOSS_DETECT_S.source),
        (
            f"survivors' hang after a silent loss {d.FLEETD_SILENT_LOSS_HANG_S.value:g} s",
            d.FLEETD_SILENT_LOSS_HANG_S.source,
        ),
        (
            "after a loss without notice: "
            + (
                "sharded state, roll back to the last checkpoint"
                if scenario.salvage_loss_s is None
                else f"survivors save their replica, {scenario.salvage_loss_s:g} s step in flight lost"
            ),
            "--sharded-state" if scenario.salvage_loss_s is None else d.SALVAGE_STEP_LOSS_S.source,
        ),
        (f"drained shard upload {d.UPLOAD_GB_PER_S.value:g} GB/s", d.UPLOAD_GB_PER_S.source),
        (f"full restart {scenario.restart_recovery_s:g} s", d.CHECKPOINT_RESTART_RECOVERY_S.source),
        (
            f"scaling efficiency {job.scaling_efficiency_per_doubling:g}/doubling",
            d.SCALING_EFFICIENCY_PER_DOUBLING.source,
        ),
        ("billing", d.MIN_CHARGE_S.source),
        (
            f"capacity discovery, every policy: {scenario.capacity_signal}"
            + (
                f", retry {scenario.capacity_retry_s():g} s after a short spot attempt"
                if scenario.capacity_signal == "probe"
                else ""
            ),
            d.CAPACITY_RETRY_S.source
            if scenario.capacity_signal == "probe"
            else "--capacity-signal instant: told the instant the trace adds capacity (an oracle)",
        ),
    ]
    if scenario.deadline_mode:
        rows.append((f"changeover d {scenario.changeover_s / 3600:g} h, every policy", d.CHANGEOVER_S.source))
    else:
        rows.append(
            (
                f"baselines' checkpoint period {scenario.baseline_interval_s(True):.0f} s "
                f"(restart) / {scenario.baseline_interval_s(False):.0f} s (torchrun)",
                "given" if scenario.periodic_checkpoint_s else "Young/Daly sqrt(2 x stall x MTBF) for this trace",
            )
        )
    return rows
