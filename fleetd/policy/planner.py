"""The planner: one pure function from what is observed to what to do, each action with a reason.

    plan(obs: Observation, cfg: FleetdConfig, now: float) -> Plan   # Plan.memory: kept for the next pass

One pass, in this order (each step a stage in fleetd/policy/stages/; docs/DESIGN.md "Layers"):
1. lifecycle: lost nodes, broken boots, overdue drains, an ended job's nodes -> Terminate;
2. budget: graded level from the forecast; at the cap (or asked to stop) -> StopJob;
3. notices, nodes on old code -> Drain; rebalance -> pre-buy / checkpoint; Young/Daly checkpoint;
4. scaling target, stragglers; the deadline call (spot, on-demand or wait); excess -> Drain;
5. placement: diversified spot first; on-demand when allowed; back to spot make-before-break;
6. budget gate: every launch cut to what fits under both caps, with the reason.
"""

from __future__ import annotations

from dataclasses import replace

from fleetd.config import FleetdConfig
from fleetd.policy import budget as budget_policy
from fleetd.policy import rebalance as rebalance_policy
from fleetd.policy.memory import with_memory
from fleetd.policy.model import BudgetLevel, Drain, LaunchPurpose, Plan, StopJob, Warn
from fleetd.policy.observation import DesiredJob, Observation, PoolStats
from fleetd.policy.stages.buying import buy, spot_pools, wave_pools_to_buy_now
from fleetd.policy.stages.checkpoints import rebalance_risk, request_periodic_checkpoint
from fleetd.policy.stages.code_version import stale_code_drains
from fleetd.policy.stages.deadline import deadline_call
from fleetd.policy.stages.pass_state import LEVEL_ORDER, PlanPass
from fleetd.policy.stages.result import assemble_plan
from fleetd.policy.stages.sizing import size_fleet
from fleetd.policy.stages.stop import end_job, finish_stop
from fleetd.policy.stages.target import choose_target
from fleetd.policy.stages.terminations import end_departed_nodes

__all__ = ["plan", "Observation", "PoolStats", "DesiredJob", "Plan"]


def _drain(p: PlanPass, drains: list[Drain]) -> None:
    for drain in drains:
        p.actions.append(drain)
        p.kept = [n for n in p.kept if n.instance_id != drain.instance_id]


def plan(obs: Observation, cfg: FleetdConfig, now: float) -> Plan:
    """The pass's plan, carrying the planner's memory once it is taken (``Plan.memory``): the
    caller keeps that value and shows it back in the next Observation."""
    return with_memory(_decide(obs, cfg, now), obs, now)


def _decide(obs: Observation, cfg: FleetdConfig, now: float) -> Plan:
    p = PlanPass(obs, cfg, now)
    end_departed_nodes(p)  # step 1
    if obs.stop_issued_at is not None:
        return finish_stop(p)

    if obs.desired_job is DesiredJob.END:
        return end_job(p)
    view = budget_policy.assess(obs.spent_usd, p.billed, p.kept, cfg)  # step 2
    if view.level is BudgetLevel.STOP or obs.desired_job is DesiredJob.STOP:
        why = view.reason if view.level is BudgetLevel.STOP else "job stop requested"
        p.actions.append(StopJob(reason=f"{why}: coordinated checkpoint, then stop every node"))
        p.target_reason = f"stopping the job: {why}"
        return assemble_plan(p, view, target=0)
    if LEVEL_ORDER.index(view.level) > LEVEL_ORDER.index(obs.budget_level):
        p.actions.append(Warn(reason=view.reason, code=f"budget-{view.level.value}"))

    _drain(p, rebalance_policy.notice_drains(p.kept, now))  # step 3
    _drain(p, stale_code_drains(p.kept, obs.code_digest))  # step 3b: a world runs one code version

    target = p.target = choose_target(p, view.level)  # step 4
    p.deadline = deadline_call(p, target)
    spot_ranked, spot_skipped = spot_pools(p)
    swap_ranked = spot_ranked  # spot for moving on-demand nodes back (make-before-break)
    if p.deadline is not None and not p.deadline.spot_allowed:
        spot_ranked, spot_skipped = [], [f"no new spot: {p.deadline.reason}"]
        if not p.deadline.swap_to_spot:
            swap_ranked = []
    risk = rebalance_risk(p, target, view.level)
    request_periodic_checkpoint(p)
    sizing = size_fleet(p, target, risk, bool(swap_ranked), view.level)

    headroom = budget_policy.headroom(obs.spent_usd, p.billed, p.kept, cfg)  # steps 5 and 6
    spot_short = False
    need = max(0, target - sizing.counted)
    cap = cfg.capacity
    settling = rebalance_policy.wave_settling(obs.nodes, now, cap.notice_coalesce_s, cap.notice_coalesce_max_s)
    if need and settling is not None:
        p.notes.append(
            f"need {need} node(s), but notices are still coming in: buying the wave's replacements "
            f"together in {settling:.1f} s (notice_coalesce_s {cap.notice_coalesce_s:g})"
        )
        need = 0
    if need and not spot_ranked:
        spot_ranked = wave_pools_to_buy_now(p, need)
    if need:
        headroom, spot_short = buy(p, need, LaunchPurpose.CAPACITY, spot_ranked, spot_skipped, headroom, view.level)
    if risk.prebuy:
        pools = [r for r in spot_ranked if r.pool not in risk.avoid]
        if pools:
            headroom, _ = buy(p, risk.prebuy, LaunchPurpose.REBALANCE_PREBUY, pools, [], headroom, view.level)
        else:
            p.notes.append("no spot pool outside the at-risk pools to pre-buy in")
    if sizing.buy_spot_for_on_demand:
        headroom, _ = buy(
            p, sizing.buy_spot_for_on_demand, LaunchPurpose.RETURN_TO_SPOT, swap_ranked, [], headroom, view.level
        )
    plan_ = assemble_plan(p, view, target=target, spot_short=spot_short)
    return replace(plan_, replan_in_s=settling) if settling is not None else plan_
