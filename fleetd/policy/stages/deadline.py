"""Step 4b: the deadline rule's call for this pass (fleetd/policy/deadline.py) from what is
observed: progress, the measured throughput at the target size, the job's changeover."""

from __future__ import annotations

from dataclasses import replace

from fleetd.policy import deadline as rule
from fleetd.policy.model import Market, NodePhase
from fleetd.policy.stages.pass_state import PlanPass


def _steps_per_s(p: PlanPass, nodes: int) -> float | None:
    """Measured throughput at ``nodes`` (deadline.steps_per_s_at); before any measurement, the
    operator's job.steps_per_s at fleet.max_nodes, scaled per node (errs low for a smaller fleet:
    more work left, an earlier safety net)."""
    measured = rule.steps_per_s_at(p.obs.throughput_by_nodes, nodes)
    if measured is not None or p.cfg.job.steps_per_s is None:
        return measured
    return rule.steps_per_s_at({p.cfg.fleet.max_nodes: p.cfg.job.steps_per_s}, nodes)


def deadline_call(p: PlanPass, target: int) -> rule.DeadlineCall | None:
    job = p.cfg.job
    deadline_at = job.deadline_at()
    if deadline_at is None or job.total_steps is None:
        return None
    obs = p.obs
    steps = [n.step for n in obs.nodes if n.step is not None]
    if obs.last_durable_checkpoint_step is not None:
        steps.append(obs.last_durable_checkpoint_step)
    started = obs.job_started_at
    if started is None:
        started = min((n.launched_at for n in obs.nodes), default=p.now)
    spot_training = sum(1 for n in p.kept if n.market is Market.SPOT and n.phase is NodePhase.RUNNING)
    pending_s = 0.0
    if not any(n.phase is NodePhase.RUNNING for n in p.kept):
        boots = [n.launched_at + job.changeover_s - p.now for n in p.kept if n.phase is NodePhase.PENDING]
        pending_s = max(0.0, min(boots, default=0.0))
    inputs = rule.DeadlineInputs(
        deadline_at=deadline_at,
        started_at=min(started, p.now),
        total_steps=float(job.total_steps),
        done_steps=float(max(steps, default=0)),
        steps_per_s=_steps_per_s(p, max(1, target)),
        changeover_s=job.changeover_s,
        full_on_spot=target > 0 and spot_training >= target,
        nodes=max(1, target),
        pending_s=pending_s,
        on_demand_nodes=sum(1 for n in p.kept if n.market is Market.ON_DEMAND),
        spot_training=spot_training,
        membership_stall_s=p.cfg.rebalance.checkpoint_stall_s + p.cfg.rebalance.reform_s,
    )
    call = rule.decide(inputs, p.now)
    if call.swap_to_spot and any(n.market is Market.ON_DEMAND and n.phase is not NodePhase.RUNNING for n in p.kept):
        # Make-before-break needs the on-demand nodes training while the spot node boots.
        call = replace(call, swap_to_spot=False)
    p.notes.append(call.reason)
    return call
