"""A stop already issued: let the nodes checkpoint and shut down, then terminate what is left;
a job that is over: terminate every node."""

from __future__ import annotations

from fleetd.policy import budget as budget_policy
from fleetd.policy.model import Plan
from fleetd.policy.stages.pass_state import PlanPass
from fleetd.policy.stages.result import assemble_plan


def finish_stop(p: PlanPass) -> Plan:
    issued = p.obs.stop_issued_at or p.now
    elapsed = p.now - issued
    reserve = p.cfg.budget.stop_reserve_s
    done = p.obs.stop_completed_at
    if done is not None and done >= issued:
        # Every second a stopped node stays up is paid for nothing (a team's pause, a budget stop).
        for node in list(p.billed):
            p.terminate(
                node,
                f"the stop is done {p.now - done:.0f} s ago (checkpoint durable, every agent told to shut down): "
                f"terminating {node.instance_id} so billing stops",
            )
    elif elapsed >= reserve:
        for node in list(p.billed):
            p.terminate(
                node,
                f"stop issued {elapsed:.0f} s ago (stop_reserve_s {reserve:.0f}): terminating "
                f"{node.instance_id} so spend stays inside the budget",
            )
    elif p.billed:
        p.notes.append(
            f"stopping: {len(p.billed)} nodes finishing checkpoint and shutdown ({elapsed:.0f} of {reserve:.0f} s)"
        )
    view = budget_policy.assess(p.obs.spent_usd, p.billed, [], p.cfg)
    return assemble_plan(p, view, target=0)


def end_job(p: PlanPass) -> Plan:
    """The job is over (it succeeded or failed, fleetd/policy/job_state.py): no trainer is left to
    checkpoint, so every billed node is released now and none is bought."""
    for node in list(p.billed):
        p.terminate(node, f"the job is over: releasing {node.instance_id} so billing stops")
    p.target_reason = "the job is over"
    view = budget_policy.assess(p.obs.spent_usd, p.billed, [], p.cfg)
    return assemble_plan(p, view, target=0)
