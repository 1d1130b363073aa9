"""Where a job of the team runs (issue 33): placement of a new job, and when a running one moves.

- A job never placed goes to the allowed region with the lowest expected cost per useful GPU-hour
  among those with capacity left for its ``min_nodes`` (the cheapest allowed one if none has).
- A placed job (nodes or a checkpoint in its region) stays unless its region has no capacity left
  for its ``min_nodes`` AND the move pays for itself: the expected saving over its remaining work,
  ``remaining_gpu_hours x (cost here - cost there)`` per useful GPU-hour, must exceed the copy of
  its checkpoint (``checkpoint_gb x transfer_usd_per_gb``) plus the changeover (``changeover_h`` at
  its burn there). "Cost here" is the caller's score for staying in a dry region (on-demand, or
  spot inflated by the expected wait): a region with no spot is not cheap, whatever its spot price.

Pure: plain data in, a `Placement` with its reason out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleetd.policy.team_model import RegionOffer, TeamJob, TeamSettings


@dataclass(frozen=True, slots=True)
class Placement:
    region: str
    moved_from: str | None  # set when the job leaves the region its checkpoint is in
    note: str


def cost_usd_per_hour(job: TeamJob, region: str, nodes: int) -> float:
    """The burn of ``nodes`` nodes for ``job`` in ``region``: in its own region it keeps its
    cheapest current nodes and buys the rest at the region's price; elsewhere every node is new."""
    if nodes <= 0:
        return 0.0
    offer = job.offer(region)
    kept = sorted(job.node_prices)[:nodes] if region == job.region and not job.paused else []
    new_price = offer.node_price_per_hour if offer is not None else max(job.node_prices, default=0.0)
    return sum(kept) + (nodes - len(kept)) * new_price


def capacity_of(capacity_left: Mapping[str, int | None], region: str) -> float:
    c = capacity_left.get(region)
    return math.inf if c is None else float(c)


def _ranked(job: TeamJob) -> list[RegionOffer]:
    return sorted(job.offers, key=lambda o: (o.usd_per_useful_gpu_hour, o.region))


def place(job: TeamJob, capacity_left: Mapping[str, int | None], settings: TeamSettings) -> Placement:
    """The region ``job`` runs in this pass, given the capacity higher-priority jobs left."""
    ranked = _ranked(job)
    here = job.offer(job.region)
    if here is None:  # never placed, or its region is no longer allowed
        fits = [o for o in ranked if capacity_of(capacity_left, o.region) >= job.min_nodes]
        best = fits[0] if fits else ranked[0]
        gone = f"its region {job.region} is no longer allowed; " if job.region is not None else ""
        if fits:
            note = (
                f"{gone}placed in {best.region}: lowest expected ${best.usd_per_useful_gpu_hour:.3f} per useful "
                f"GPU-hour among allowed regions with capacity for its {job.min_nodes} nodes"
            )
        else:
            note = (
                f"{gone}no allowed region has capacity for its {job.min_nodes} nodes; waits for {best.region}, "
                f"the cheapest (${best.usd_per_useful_gpu_hour:.3f} per useful GPU-hour)"
            )
        return Placement(best.region, job.region, note)
    room_here = capacity_of(capacity_left, here.region)
    if room_here >= job.min_nodes:
        return Placement(here.region, None, f"stays in {here.region}")
    short = f"{here.region} has capacity for {room_here:g} of its {job.min_nodes} nodes"
    targets = [o for o in ranked if o.region != here.region and capacity_of(capacity_left, o.region) >= job.min_nodes]
    if not targets:
        return Placement(here.region, None, f"{short}, and no other allowed region has room for it")
    there = targets[0]
    saving = job.remaining_gpu_hours * (here.usd_per_useful_gpu_hour - there.usd_per_useful_gpu_hour)
    copy = job.checkpoint_gb * settings.transfer_usd_per_gb
    changeover = settings.changeover_h * cost_usd_per_hour(job, there.region, job.need())
    sums = (
        f"saving ${saving:.2f} over its {job.remaining_gpu_hours:.1f} remaining GPU-hours "
        f"(${here.usd_per_useful_gpu_hour:.3f} -> ${there.usd_per_useful_gpu_hour:.3f} per useful GPU-hour) "
        f"against copy ${copy:.2f} ({job.checkpoint_gb:g} GB) + changeover ${changeover:.2f} "
        f"({settings.changeover_h:g} h at its burn)"
    )
    if saving > copy + changeover:
        return Placement(there.region, here.region, f"{short}: moves to {there.region}, it pays: {sums}")
    return Placement(here.region, None, f"{short}; a move to {there.region} does not pay: {sums}")
