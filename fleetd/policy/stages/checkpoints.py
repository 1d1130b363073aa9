"""Step 3: checkpoints and pre-buys for nodes at risk, and the periodic Young/Daly checkpoint."""

from __future__ import annotations

from fleetd.policy import checkpointing
from fleetd.policy import rebalance as rebalance_policy
from fleetd.policy.model import BudgetLevel, NodePhase
from fleetd.policy.stages.pass_state import PlanPass


def rebalance_risk(p: PlanPass, target: int, level: BudgetLevel) -> rebalance_policy.RiskPlan:
    """Pre-buys for nodes with a rebalance recommendation, and a checkpoint if the last is old."""
    obs, cfg = p.obs, p.cfg
    risk = rebalance_policy.plan_risk(
        p.kept,
        target,
        obs.rebalance_prebuys_last_hour,
        level in (BudgetLevel.NORMAL, BudgetLevel.WARN),
        cfg,
        p.now,
    )
    p.notes.extend(risk.notes)
    if risk.at_risk:
        p.request_checkpoint(
            *rebalance_policy.checkpoint_if_stale(
                why="rebalance recommendation",
                last_durable_at=obs.last_durable_checkpoint_at,
                last_request_at=obs.last_checkpoint_request_at,
                max_age_s=cfg.rebalance.max_checkpoint_age_s,
                retry_s=cfg.rebalance.checkpoint_retry_s,
                now=p.now,
            )
        )
    return risk


def request_periodic_checkpoint(p: PlanPass) -> None:
    """Bound the work a loss without notice rolls back (checkpointing.py: Young/Daly)."""
    if not p.cfg.rebalance.young_daly_checkpoints:
        return
    training = sum(1 for n in p.kept if n.phase is NodePhase.RUNNING)
    cadence = checkpointing.cadence(p.obs.pool_stats, training, p.cfg.rebalance.checkpoint_stall_s)
    p.request_checkpoint(
        *checkpointing.periodic_checkpoint(
            cadence,
            last_durable_at=p.obs.last_durable_checkpoint_at,
            last_request_at=p.obs.last_checkpoint_request_at,
            retry_s=p.cfg.rebalance.checkpoint_retry_s,
            now=p.now,
        )
    )
