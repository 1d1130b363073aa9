"""Every default the simulator uses, each with the source it comes from.

A policy's result is only as honest as its inputs, so no number in fleetd/sim is written inline:
it is a `Sourced` value here, and `fleetd simulate` prints the sources next to the results.
Measured values from bench/rebalance.py (its last line is one JSON object) replace the re-form
figures below when its results file is found (`measured_overrides`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fleetd.policy.ledger import MINIMUM_CHARGE_S


@dataclass(frozen=True, slots=True)
class Sourced:
    value: float
    source: str


# --- rendezvous and recovery (DESIGN.md "Rendezvous facts measured here") -----------------
FLEETD_REFORM_S = Sourced(
    0.667,
    "measured 2026-11-27 (after the re-form cuts, 36ab7fa): bench/rebalance.py notice_to_training_s "
    "median, notice -> every survivor training at the smaller size (idle 2-core box; a toy model's "
    "checkpoint included, the job's own save is added as the checkpoint stall); also the survivors' "
    "round after a silent loss's poke",
)
# A join stalls the ranks already training from the newcomer's hold-checkpoint request, which it
# sends right before entering the rendezvous with its warm pool ready (agent/supervise/
# torchrun_main.py), until every rank has stepped at the larger size: their workers restart into
# the new round and resume. The newcomer's own start-up comes before and costs them nothing.
FLEETD_JOIN_REFORM_S = Sourced(
    1.04,
    "measured 2026-11-27 (36ab7fa): bench/rebalance.py join_pause_s median, the running ranks' last "
    "step at the old size -> every rank training at the larger size (idle 2-core box)",
)
TORCHRUN_REFORM_S = Sourced(40.0, "DESIGN.md: torchrun defaults, 35-45 s to re-form per join or leave (midpoint)")
# A node lost with no notice: fleetd learns of it from two signals (lifecycle.py's rule): the
# agent's last will arrives after MQTT keep-alive x 1.5, and the EC2 state change soon after.
FLEETD_LOSS_DETECT_S = Sourced(
    22.5, "MQTT keep-alive 15 s (shared/settings.py) x 1.5 until the broker sends the last will"
)


# The survivors' hang after a loss without notice is not the planner's detection: fleetd's
# rendezvous steering removes a member quiet on both the store (no heartbeat) and the broker (no
# message from its agent) for loss.silent_after_s while the job made no progress for as long, and
# pokes the survivors into a new round (fleetd/rendezvous/decide.py, silent_everywhere). All three
# clocks start at the loss at the latest (a vanished node's last heartbeat and report come before
# it), so the hang is at most silent_after_s. Taken from the daemon's own config default
# (fleetd.config.LossConfig), not a copy of it.
def _silent_loss_hang() -> Sourced:
    from fleetd.config import LossConfig

    loss = LossConfig()
    return Sourced(
        loss.silent_after_s,
        f"fleetd.toml [loss] default (fleetd/config.py LossConfig): a member quiet on the store and the "
        f"broker for silent_after_s {loss.silent_after_s:g} s while the job made no progress is removed and "
        f"the survivors are poked into a new round",
    )


FLEETD_SILENT_LOSS_HANG_S = _silent_loss_hang()
# A peer lost without notice: the survivors hold a full replica of the state after the last step
# they completed and save it before their workers restart (agent/trainer/salvage.py), so the
# job loses the step in flight instead of rolling back to the last checkpoint.
SALVAGE_STEP_LOSS_S = Sourced(
    1.0,
    "assumption: one data-parallel step (~1 s) is in flight and lost when a peer vanishes; the "
    "survivors save the step they completed (agent/trainer/salvage.py, 0-1 steps lost measured "
    "in tests/test_elastic_e2e.py). Sharded state (--sharded-state) cannot be saved this way",
)


# Capacity is discovered by trying, by every policy alike (fleetd/sim/engine.py): after a spot
# attempt that came back short the next one comes this much later. It is the daemon's own wait
# after a capacity error (the planner skips the pool until the TTL ends), taken from its config
# default, not a copy, so fleetd and the baselines retry on one number.
def _capacity_retry() -> Sourced:
    from fleetd.config import CapacityConfig

    ttl = CapacityConfig.model_fields["capacity_error_ttl_s"].default
    return Sourced(
        float(ttl),
        f"fleetd.toml [capacity] capacity_error_ttl_s default (fleetd/config.py CapacityConfig): "
        f"after a capacity error fleetd tries the pool again {ttl:g} s later; every simulated policy "
        f"retries a short spot attempt after the same interval (EC2 has no capacity-returned signal)",
    )


CAPACITY_RETRY_S = _capacity_retry()
# Planner passes between events in the simulator (events wake it at once, as in the daemon).
SIM_PASS_INTERVAL_S = Sourced(
    300.0,
    "simulator choice: between events, passes run when a time-driven input of the planner "
    "crosses its threshold and at least every 300 s (the daemon passes every 10 s)",
)
DEADLINE_PASS_INTERVAL_S = Sourced(
    600.0,
    "simulator choice for multi-day deadline jobs: passes also run at every event and at each "
    "time the planner's inputs change (capacity-error TTL, spot_wait_s, the deadline guard)",
)
# SkyPilot managed jobs relaunch the whole cluster on any loss: provision, set up, restore.
CHECKPOINT_RESTART_RECOVERY_S = Sourced(
    300.0,
    "assumption: full cluster relaunch (provision + boot ~2-3 min, setup, restore from S3); "
    "SkyPilot publishes no single figure",
)

# A drained node uploads its shard of the coordinated checkpoint before it leaves (DESIGN.md
# step 3); the simulator charges checkpoint_gb / world size at this rate.
UPLOAD_GB_PER_S = Sourced(
    0.5,
    "assumption: multipart upload from one node to S3 in-region at ~half of a p3.2xlarge's "
    "'up to 10 Gbit/s' network (AWS instance-type page); run bench/upload.py for your own",
)

# --- the job ------------------------------------------------------------------------------
CHECKPOINT_STALL_S = Sourced(
    5.0,
    "assumption: training paused while a few-GB state is written to local disk (torch DCP); "
    "the upload to S3 runs in the background. Pass --checkpoint-stall-s with your own save time",
)
PERIODIC_CHECKPOINT_S = Sourced(
    1800.0,
    "assumption: a common periodic checkpoint cadence (every 30 min) for jobs without fleetd",
)
FLEETD_MAX_CHECKPOINT_AGE_S = Sourced(600.0, "fleetd config rebalance.max_checkpoint_age_s default (fleetd/config.py)")
SCALING_EFFICIENCY_PER_DOUBLING = Sourced(
    0.95,
    "assumption: data-parallel training keeps 95 % of per-node throughput per doubling of nodes",
)
NOTICE_LEAD_S = Sourced(120.0, "AWS: the spot interruption notice comes ~2 minutes ahead")
NO_NOTICE_SHARE = Sourced(
    0.05,
    "assumption: AWS's notice is best effort and AWS gives no figure; 1 loss in 20 unannounced",
)
# The ledger's own minimum (fleetd.policy.ledger.charge bills the simulator's nodes too).
MIN_CHARGE_S = Sourced(MINIMUM_CHARGE_S, "AWS: Linux instances are billed per second, 60 s minimum")

# --- single-node deadline jobs (Can't Be Late, NSDI'24) ------------------------------------
CHANGEOVER_S = Sourced(
    0.2 * 3600,
    "Can't Be Late (NSDI'24): restart overhead d = 0.2 h (its larger setting) for a cold "
    "start of a node and restore from the last checkpoint",
)
# A node bought during a deadline job is paid for the changeover d before it trains; its agent
# reports (MQTT status) once the instance is up, before it restores the checkpoint.
AGENT_UP_S = Sourced(
    120.0,
    "assumption: a GPU instance boots and its agent reports within ~2 min; the rest of the "
    "changeover is restoring the checkpoint",
)

# --- prices (us-east-1) -------------------------------------------------------------------
# On-demand: AWS public Linux prices for us-east-1. Spot: on-demand x (1 - savings) from the
# Spot Advisor snapshot shared/traces/aws_spot_advisor_gpu_snapshot_2025-06.csv (us-east-1 row).
ON_DEMAND_USD_PER_HOUR = {
    "p3.2xlarge": 3.06,
    "p3.8xlarge": 12.24,
    "g4dn.xlarge": 0.526,
    "g4dn.12xlarge": 3.912,
    "g5.xlarge": 1.006,
    "g5.12xlarge": 5.672,
    "g6.xlarge": 0.805,
    "p4d.24xlarge": 32.7726,
}
SPOT_SAVINGS_PCT = {  # us-east-1, Spot Advisor snapshot 2025-06
    "p3.2xlarge": 80,
    "p3.8xlarge": 86,
    "g4dn.xlarge": 64,
    "g4dn.12xlarge": 64,
    "g5.xlarge": 59,
    "g5.12xlarge": 58,
    "g6.xlarge": 49,
    "p4d.24xlarge": 67,
}
PRICE_SOURCE = (
    "on-demand: AWS us-east-1 list price; spot: on-demand x (1 - savings) from the Spot "
    "Advisor snapshot 2025-06 (shared/traces)"
)


def prices_for(instance_type: str) -> tuple[float, float]:
    """(spot, on-demand) USD per hour for a known instance type."""
    try:
        od = ON_DEMAND_USD_PER_HOUR[instance_type]
        saving = SPOT_SAVINGS_PCT[instance_type]
    except KeyError:
        known = ", ".join(sorted(ON_DEMAND_USD_PER_HOUR))
        raise ValueError(
            f"no default price for {instance_type}; pass --spot-price and --on-demand-price (known: {known})"
        ) from None
    return round(od * (1 - saving / 100.0), 4), od


def instance_type_for_trace(trace_name: str) -> tuple[str, str]:
    """(instance type, why): trace files are named after their family; 1-GPU size assumed."""
    name = trace_name.lower()
    for family, itype in (("p3", "p3.2xlarge"), ("g4dn", "g4dn.xlarge"), ("g5", "g5.xlarge")):
        if name.startswith(family):
            return itype, f"trace named after {family}; its 1-GPU size assumed"
    return "g5.xlarge", "default instance type"


def measured_overrides(bench_dir: Path | None = None) -> dict[str, Sourced]:
    """Measured figures from bench results, when the benchmarks have been run here.

    bench/rebalance.py prints one JSON object as its last line; saved as
    ``bench/results/rebalance.json`` (or under $FLEETD_BENCH_RESULTS), its medians replace the
    DESIGN.md figures: ``notice_to_training_s`` -> fleetd's re-form time (notice to every
    survivor training, so it includes a toy model's checkpoint; the job's own stall is added
    separately), ``join_pause_s`` -> fleetd's join round (the running ranks' pause), ``default_notice_to_training_s``
    -> torchrun's.
    """
    root = bench_dir or Path(os.environ.get("FLEETD_BENCH_RESULTS", "bench/results"))
    path = root / "rebalance.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    found: dict[str, Sourced] = {}
    if not isinstance(doc, dict):
        return found
    for key, target in (
        ("notice_to_training_s", "reform_s"),
        ("join_pause_s", "join_reform_s"),
        ("default_notice_to_training_s", "torchrun_reform_s"),
    ):
        value = doc.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found[target] = Sourced(float(value), f"measured: {path} {key} (bench/rebalance.py)")
    return found
