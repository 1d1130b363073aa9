"""The status snapshot: what the reconcile loop knew at the end of its last pass, as one JSON file.

``<fleet.state_dir>/status.json`` is rewritten atomically every pass (write a temporary file in the
same directory, fsync, rename), so ``fleetd status`` (another process, possibly another user) always
reads a complete, consistent picture while the daemon runs, without touching the daemon's SQLite
connection or locks. fleetd.db stays the durable record (launches, instances, pool statistics);
the snapshot adds what only lives in the loop's memory: agent telemetry, the rendezvous round and the
budget as the planner saw it.

The file is a versioned pydantic model like every other cross-process payload: a reader refuses a
newer schema instead of mis-reading it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleetd.atomic_file import write_atomically
from fleetd.job_record import JobView
from fleetd.policy.model import BudgetStatus, Node
from fleetd.protocol.errors import ProtocolError
from fleetd.stall_record import StallView

SNAPSHOT_VERSION = 2
SNAPSHOT_NAME = "status.json"

NonNegative = Annotated[float, Field(ge=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeView(_Frozen):
    instance_id: str
    pool: str  # "<type>@<zone>"
    market: str
    price_per_hour: NonNegative
    state: str  # the planner's phase: pending | running | draining | leaving | terminated
    ec2_state: str
    launched_at: float
    gpu_util_pct: float | None = None
    steps_per_s: float | None = None
    step: int | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_at: float | None = None
    notice_at: float | None = None
    # Why this node is not pulling its weight (gpu-idle, input-bound), with the numbers; None: no
    # such sign measured (fleetd.policy.scaling.node_flag).
    flag: str | None = None


class BudgetView(_Frozen):
    total_usd: float
    max_usd_per_hour: float
    spent_usd: NonNegative
    burn_usd_per_hour: NonNegative
    forecast_usd: NonNegative
    level: str
    reason: str = ""

    @property
    def left_usd(self) -> float:
        return max(self.total_usd - self.spent_usd, 0.0)

    @property
    def hours_to_cap(self) -> float | None:
        """At the current burn rate; None when nothing is burning."""
        return self.left_usd / self.burn_usd_per_hour if self.burn_usd_per_hour > 0 else None


class RendezvousView(_Frozen):
    round: int
    world_size: int


class CheckpointView(_Frozen):
    """The newest checkpoint whose manifest is in S3 (durable)."""

    step: int
    durable_at: float


class PoolView(_Frozen):
    """One configured pool: offered to the planner, or excluded with the reason."""

    pool: str  # "<type>@<zone>"
    offered: bool
    reason: str | None = None  # why it is excluded
    gpus: int | None = None
    gpu_model: str | None = None
    relative_throughput: float | None = None
    on_demand_price: float | None = None
    spot_price: float | None = None
    # Version 2: the planner skips the pool for spot until then (a capacity error, capacity_error_ttl_s).
    capacity_error_until: float | None = None


class StatusSnapshot(_Frozen):
    schema_version: int = SNAPSHOT_VERSION
    fleet: str
    written_at: float  # epoch seconds
    reconcile_interval_s: float
    pid: int = Field(default_factory=os.getpid)
    target_nodes: int | None = None
    nodes: tuple[NodeView, ...] = ()
    budget: BudgetView | None = None
    rendezvous: RendezvousView | None = None
    checkpoint: CheckpointView | None = None
    # When the planner stopped the job (budget cap or an operator's stop): nodes are being
    # checkpointed, shut down and released.
    stop_issued_at: float | None = None
    pools: tuple[PoolView, ...] = ()
    # Stalled-job detection (fleetd/stall_watch.py): the current stall and every one so far.
    stall: StallView | None = None
    # The job's lifecycle (fleetd/policy/job_state.py): pending ... succeeded/failed/cancelled.
    job: JobView | None = None
    # Version 2: the region the daemon runs in (a team job may move: fleetd/team/region_file.py),
    # and the job's measured steps/s per world size (the team's scaling and deadline inputs).
    region: str | None = None
    throughput_by_nodes: dict[int, float] = Field(default_factory=dict)
    team_member: bool = False  # [team] member: its allotment (none yet: it waits) is in its status

    @field_validator("schema_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v > SNAPSHOT_VERSION:
            raise ValueError(f"snapshot schema {v} is newer than this fleetd ({SNAPSHOT_VERSION})")
        return v

    @property
    def live_nodes(self) -> tuple[NodeView, ...]:
        """Nodes EC2 still runs (what the fleet is paying for)."""
        return tuple(n for n in self.nodes if n.ec2_state in ("pending", "running"))


def build_snapshot(
    *,
    now: float,
    fleet: str,
    reconcile_interval_s: float,
    nodes: Iterable[Node],
    budget: BudgetStatus | None = None,
    budget_total_usd: float = 0.0,
    budget_max_usd_per_hour: float = 0.0,
    target_nodes: int | None = None,
    rendezvous: tuple[int, int] | None = None,
    checkpoint: tuple[int, float] | None = None,
    node_checkpoints: Mapping[str, tuple[int, float]] | None = None,
    stop_issued_at: float | None = None,
    pools: Iterable[Any] = (),
    flags: Mapping[str, str] | None = None,
    stall: StallView | None = None,
    job: JobView | None = None,
    region: str | None = None,
    capacity_errors: Mapping[str, float] | None = None,
    throughput_by_nodes: Mapping[int, float] | None = None,
    team_member: bool = False,
) -> StatusSnapshot:
    """From the planner's own inputs and outputs of one pass (``rendezvous``: (round, world size);
    ``checkpoint``: (step, durable_at); ``node_checkpoints``: instance id -> (step, saved_at))."""
    node_checkpoints = node_checkpoints or {}
    flags = flags or {}
    views = []
    for n in nodes:
        ckpt = node_checkpoints.get(n.instance_id)
        views.append(
            NodeView(
                instance_id=n.instance_id,
                pool=str(n.pool),
                market=str(n.market),
                price_per_hour=n.price_per_hour,
                state=str(n.phase),
                ec2_state=n.ec2_state,
                launched_at=n.launched_at,
                gpu_util_pct=n.gpu_util_pct,
                steps_per_s=n.steps_per_s,
                step=n.step,
                last_checkpoint_step=ckpt[0] if ckpt else None,
                last_checkpoint_at=ckpt[1] if ckpt else None,
                notice_at=n.notice_at,
                flag=flags.get(n.instance_id),
            )
        )
    budget_view = None
    if budget is not None:
        budget_view = BudgetView(
            total_usd=budget_total_usd,
            max_usd_per_hour=budget_max_usd_per_hour,
            spent_usd=budget.spent_usd,
            burn_usd_per_hour=budget.burn_usd_per_hour,
            forecast_usd=budget.forecast_usd,
            level=str(budget.level),
            reason=budget.reason,
        )
    return StatusSnapshot(
        fleet=fleet,
        written_at=now,
        reconcile_interval_s=reconcile_interval_s,
        target_nodes=target_nodes,
        nodes=tuple(sorted(views, key=lambda v: v.instance_id)),
        budget=budget_view,
        rendezvous=RendezvousView(round=rendezvous[0], world_size=rendezvous[1]) if rendezvous else None,
        checkpoint=CheckpointView(step=checkpoint[0], durable_at=checkpoint[1]) if checkpoint else None,
        stop_issued_at=stop_issued_at,
        pools=tuple(pool_view(r, (capacity_errors or {}).get(str(r.pool))) for r in pools),
        stall=stall,
        job=job,
        region=region,
        throughput_by_nodes=dict(throughput_by_nodes or {}),
        team_member=team_member,
    )


def pool_view(row: Any, capacity_error_until: float | None = None) -> PoolView:
    """From a fleetd.reconcile.pool_offers.PoolRow (and the pool's spot capacity error, if any)."""
    o = row.offer
    return PoolView(
        pool=str(row.pool),
        offered=o is not None,
        reason=row.excluded,
        gpus=o.gpus if o else None,
        gpu_model=o.gpu_model if o else None,
        relative_throughput=o.relative_throughput if o else None,
        on_demand_price=row.on_demand_price,
        spot_price=row.spot_price,
        capacity_error_until=capacity_error_until,
    )


def snapshot_path(state_dir: Path) -> Path:
    return Path(state_dir) / SNAPSHOT_NAME


def write_snapshot(state_dir: Path, snapshot: StatusSnapshot) -> Path:
    """Atomically replace ``<state_dir>/status.json``. Blocking: call it via asyncio.to_thread."""
    # compact JSON: 2,000 nodes stay ~0.5 MB
    return write_atomically(snapshot_path(state_dir), snapshot.model_dump_json().encode(), mode=0o640)


def read_snapshot(state_dir: Path) -> StatusSnapshot | None:
    """The last snapshot, or None if the daemon never wrote one. Raises ProtocolError if the file
    is not a snapshot this version understands."""
    path = snapshot_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return StatusSnapshot.model_validate_json(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "<file>"
        raise ProtocolError(f"{path}: {where}: {first['msg']}") from None
