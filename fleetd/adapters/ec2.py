"""EC2 through aiobotocore: find fleetd's instances, buy capacity, terminate what fleetd owns.

The reconcile loop talks to :class:`Ec2Api` only, so tests and the simulator can put a fake in its
place; :class:`AioEc2` is the production one. Instances are tagged and discovered by the fleet tag
(a restarted controller adopts what runs), a launch is idempotent by its client token, and only
instances that carry this fleet's tag are terminated.
(docs/DESIGN.md "Placement and deadlines (fleetd/policy/placement.py, fleetd/policy/deadline.py)")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from fleetd.adapters.aws_errors import AwsError, aws_call, classify_code
from fleetd.adapters.ec2_times import transition_time
from fleetd.adapters.launch_template import TemplateRef, ensure_launch_template
from fleetd.policy.model import Market, PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

TAG_FLEET = "fleetd:fleet"
TAG_JOB = "fleetd:job"
TAG_POOL = "fleetd:pool"
TAG_LAUNCH = "fleetd:launch"
TAG_MARKET = "fleetd:market"

# Every EC2 state: discovery must see stopped and terminating instances too (they still matter
# for spend and for the two-signal rule), and terminated ones while EC2 still lists them.
ALL_STATES = ("pending", "running", "shutting-down", "stopping", "stopped", "terminated")


@dataclass(frozen=True, slots=True)
class Ec2Instance:
    instance_id: str
    pool: PoolId
    market: Market
    state: str  # EC2 state name
    launched_at: float  # epoch seconds
    launch_token: str | None = None
    state_reason: str = ""  # e.g. "Server.SpotInstanceTermination"
    # When it left running for shutting-down/terminated, from StateTransitionReason (billing ends
    # there); None while it runs or when EC2 does not say.
    ended_at: float | None = None

    @property
    def live(self) -> bool:
        """Pending or running: a node the fleet has (stopped ones are not useful capacity)."""
        return self.state in ("pending", "running")


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One CreateFleet request as the reconcile loop planned it."""

    token: str
    count: int
    market: Market
    pools: tuple[PoolId, ...]  # ranked, best first
    max_price_per_hour: float | None = None  # per instance, spot only
    max_total_price: float | None = None  # USD/h for the whole request


@dataclass(frozen=True, slots=True)
class PoolFailure:
    """A pool (or, pool None, the whole request) that could not deliver, in project terms."""

    pool: PoolId | None
    kind: str  # AwsError.kind: capacity | throttled | transient | permanent
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class LaunchResult:
    token: str
    instances: tuple[Ec2Instance, ...] = ()
    failures: tuple[PoolFailure, ...] = ()
    # True when the instances were found by their token instead of bought by this call.
    already_launched: bool = False


class Ec2Api(Protocol):
    """What the reconcile loop needs from EC2. Implementations raise only AwsError."""

    async def list_instances(self) -> list[Ec2Instance]:
        """Every instance carrying this fleet's tag, terminated ones included while EC2 shows them."""
        ...

    async def launch(self, spec: LaunchSpec) -> LaunchResult: ...

    async def terminate(self, instance_ids: Sequence[str]) -> list[str]:
        """Terminate those of ``instance_ids`` that carry this fleet's tag; return their ids."""
        ...


def launch_token(fleet: str, seq: int, count: int, market: Market, pools: Sequence[PoolId]) -> str:
    """A ClientToken (<= 64 ASCII chars) that is the same whenever the same launch is planned
    again at the same point of the fleet's history (``seq``: number of launches settled before)."""
    body = json.dumps([fleet, seq, count, str(market), [str(p) for p in pools]], separators=(",", ":"))
    return "fleetd-" + hashlib.sha256(body.encode()).hexdigest()[:40]


def _epoch(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value or 0.0)


def _tags(item: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags", []) or []}


class AioEc2:
    """:class:`Ec2Api` over an aiobotocore EC2 client (the caller owns the client's lifetime)."""

    def __init__(
        self,
        client: Any,
        *,
        fleet: str,
        job: str,
        template: TemplateRef | None = None,  # None: a client that only reads (enrolment)
        subnets_by_zone: Mapping[str, str] | None = None,
    ):
        self._client = client
        self.fleet = fleet
        self.job = job
        self.template = template
        # With subnets configured, each pool's zone is addressed through its subnet (VPC
        # placement); without, through AvailabilityZone (default VPC).
        self.subnets_by_zone = dict(subnets_by_zone or {})
        self._zone_of_subnet = {s: z for z, s in self.subnets_by_zone.items()}

    async def use_template_for(self, cfg: Any) -> TemplateRef:
        """fleetd's own launch template brought up to ``cfg`` (a submitted job's new version in
        its user data); launches from now on name the new template version."""
        self.template = await ensure_launch_template(self._client, cfg)
        return self.template

    # -- discovery ------------------------------------------------------------------------------
    async def list_instances(self) -> list[Ec2Instance]:
        return await self._describe([{"Name": f"tag:{TAG_FLEET}", "Values": [self.fleet]}])

    async def _describe(self, filters: list[dict[str, Any]], instance_ids: Sequence[str] = ()) -> list[Ec2Instance]:
        params: dict[str, Any] = {"Filters": [*filters, {"Name": "instance-state-name", "Values": list(ALL_STATES)}]}
        if instance_ids:
            # A filter, not InstanceIds=: an unknown id must mean "not ours", not an error.
            params["Filters"].append({"Name": "instance-id", "Values": list(instance_ids)})
        out = []
        async with aws_call("DescribeInstances"):
            async for page in self._client.get_paginator("describe_instances").paginate(**params):
                for reservation in page.get("Reservations", []):
                    for item in reservation.get("Instances", []):
                        out.append(self._instance(item))
        return out

    def _instance(self, item: Mapping[str, Any]) -> Ec2Instance:
        tags = _tags(item)
        market = Market.SPOT if item.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND
        return Ec2Instance(
            instance_id=item["InstanceId"],
            pool=PoolId(item["InstanceType"], item.get("Placement", {}).get("AvailabilityZone", "")),
            market=market,
            state=item.get("State", {}).get("Name", "unknown"),
            launched_at=_epoch(item.get("LaunchTime")),
            launch_token=tags.get(TAG_LAUNCH),
            state_reason=(item.get("StateReason") or {}).get("Code", ""),
            ended_at=transition_time(item.get("StateTransitionReason") or "")
            if item.get("State", {}).get("Name") in ("shutting-down", "terminated")
            else None,
        )

    async def fleet_instance_state(self, instance_id: str) -> str | None:
        """EC2's state of ``instance_id`` if it carries this fleet's tag; None if it does not (or
        does not exist). Node enrolment (fleetd/identity) asks this before issuing a certificate."""
        found = await self._describe([{"Name": f"tag:{TAG_FLEET}", "Values": [self.fleet]}], (instance_id,))
        return next((i.state for i in found if i.instance_id == instance_id), None)

    async def instances_of_launch(self, token: str) -> list[Ec2Instance]:
        return await self._describe(
            [
                {"Name": f"tag:{TAG_FLEET}", "Values": [self.fleet]},
                {"Name": f"tag:{TAG_LAUNCH}", "Values": [token]},
            ]
        )

    # -- launch ---------------------------------------------------------------------------------
    def create_fleet_request(self, spec: LaunchSpec) -> dict[str, Any]:
        overrides = []
        for priority, pool in enumerate(spec.pools):
            o: dict[str, Any] = {"InstanceType": pool.instance_type, "Priority": float(priority)}
            if pool.zone in self.subnets_by_zone:
                o["SubnetId"] = self.subnets_by_zone[pool.zone]
            else:
                o["AvailabilityZone"] = pool.zone
            if spec.market is Market.SPOT and spec.max_price_per_hour is not None:
                o["MaxPrice"] = f"{spec.max_price_per_hour:.4f}"
            overrides.append(o)
        spot = spec.market is Market.SPOT
        capacity_type = "spot" if spot else "on-demand"
        target: dict[str, Any] = {
            "TotalTargetCapacity": spec.count,
            "DefaultTargetCapacityType": capacity_type,
            ("SpotTargetCapacity" if spot else "OnDemandTargetCapacity"): spec.count,
        }
        options: dict[str, Any] = (
            {"AllocationStrategy": "price-capacity-optimized", "InstanceInterruptionBehavior": "terminate"}
            if spot
            # On-demand has no interruption risk: follow the planner's ranking.
            else {"AllocationStrategy": "prioritized"}
        )
        if spec.max_total_price is not None:
            options["MaxTotalPrice"] = f"{spec.max_total_price:.4f}"
        tags = [
            {"Key": TAG_FLEET, "Value": self.fleet},
            {"Key": TAG_JOB, "Value": self.job},
            {"Key": TAG_LAUNCH, "Value": spec.token},
            {"Key": TAG_MARKET, "Value": str(spec.market)},
        ]
        if self.template is None:
            raise ValueError("this EC2 client was built without a launch template: it cannot launch")
        return {
            "Type": "instant",
            "ClientToken": spec.token,
            "TargetCapacitySpecification": target,
            ("SpotOptions" if spot else "OnDemandOptions"): options,
            "LaunchTemplateConfigs": [{"LaunchTemplateSpecification": self.template.spec(), "Overrides": overrides}],
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "fleet", "Tags": tags[:3]},
            ],
        }

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        if spec.count < 1 or not spec.pools:
            raise ValueError(f"launch needs count >= 1 and at least one pool: {spec}")
        # Idempotent twice over: CreateFleet's ClientToken, and first a look for instances tagged with
        # the token (moto ignores ClientToken; AWS's guarantee ends with the token's window).
        found = [i for i in await self.instances_of_launch(spec.token) if i.state != "terminated"]
        if found:
            log.info("launch_already_done", token=spec.token, instances=[i.instance_id for i in found])
            return LaunchResult(spec.token, tuple(found), already_launched=True)
        request = self.create_fleet_request(spec)
        async with aws_call("CreateFleet"):
            resp = await self._client.create_fleet(**request)
        result = self._launch_result(spec, resp)
        if result.instances:
            await self._tag_pools(result.instances)
        return result

    def _pool_of_override(self, spec: LaunchSpec, lto: Mapping[str, Any] | None) -> PoolId | None:
        o = (lto or {}).get("Overrides") or {}
        itype = o.get("InstanceType")
        zone = o.get("AvailabilityZone") or self._zone_of_subnet.get(o.get("SubnetId", ""))
        if itype and zone:
            return PoolId(itype, zone)
        candidates = [p for p in spec.pools if p.instance_type == itype] if itype else []
        return candidates[0] if len(candidates) == 1 else None

    def _launch_result(self, spec: LaunchSpec, resp: Mapping[str, Any]) -> LaunchResult:
        instances = []
        for group in resp.get("Instances", []) or []:
            pool = self._pool_of_override(spec, group.get("LaunchTemplateAndOverrides"))
            market = Market.SPOT if group.get("Lifecycle") == "spot" else Market.ON_DEMAND
            for iid in group.get("InstanceIds", []):
                instances.append(
                    Ec2Instance(
                        instance_id=iid,
                        pool=pool or PoolId(group.get("InstanceType", "?"), "?"),
                        market=market,
                        state="pending",
                        launched_at=0.0,  # the next DescribeInstances fills it in
                        launch_token=spec.token,
                    )
                )
        failures = []
        for err in resp.get("Errors", []) or []:
            code = err.get("ErrorCode", "Unknown")
            failures.append(
                PoolFailure(
                    pool=self._pool_of_override(spec, err.get("LaunchTemplateAndOverrides")),
                    kind=classify_code(code).kind,
                    code=code,
                    message=err.get("ErrorMessage", ""),
                )
            )
        return LaunchResult(spec.token, tuple(instances), tuple(failures))

    async def _tag_pools(self, instances: Sequence[Ec2Instance]) -> None:
        """Best effort: the pool is also derivable from type + zone, so a failure here is logged."""
        by_pool: dict[PoolId, list[str]] = {}
        for inst in instances:
            by_pool.setdefault(inst.pool, []).append(inst.instance_id)
        for pool, ids in by_pool.items():
            try:
                async with aws_call("CreateTags"):  # fleetd:pool, once EC2 has chosen the pool
                    await self._client.create_tags(Resources=ids, Tags=[{"Key": TAG_POOL, "Value": str(pool)}])
            except AwsError as exc:
                log.warning("pool_tag_failed", pool=str(pool), instances=ids, error=str(exc))

    # -- terminate ------------------------------------------------------------------------------
    async def terminate(self, instance_ids: Sequence[str]) -> list[str]:
        if not instance_ids:
            return []
        # Re-check ownership on EC2 itself right before terminating: an id from a stale record
        # or a bug elsewhere must never take down someone else's machine.
        owned = await self._owned(instance_ids)
        ids = sorted({i.instance_id for i in owned if i.state != "terminated"})
        refused = sorted(set(instance_ids) - {i.instance_id for i in owned})
        if refused:
            log.error("terminate_refused_not_ours", fleet=self.fleet, instances=refused)
        if not ids:
            return []
        async with aws_call("TerminateInstances"):
            await self._client.terminate_instances(InstanceIds=ids)
        return ids

    async def _owned(self, instance_ids: Sequence[str]) -> list[Ec2Instance]:
        """The fleet's instances among ``instance_ids``: asked by id, the fleet tag checked on the
        answer (a tag filter is evaluated over every instance on moto: 3 s against 27 ms at 2,000).
        An unknown id fails a by-id call as a whole: then the filter answers, as before."""
        out: list[Ec2Instance] = []
        try:
            async with aws_call("DescribeInstances"):
                async for page in self._client.get_paginator("describe_instances").paginate(
                    InstanceIds=list(instance_ids)
                ):
                    out += [
                        self._instance(i)
                        for r in page.get("Reservations", [])
                        for i in r.get("Instances", [])
                        if _tags(i).get(TAG_FLEET) == self.fleet
                    ]
            return out
        except AwsError as exc:
            if not exc.code.startswith("InvalidInstanceID"):
                raise
        return await self._describe([{"Name": f"tag:{TAG_FLEET}", "Values": [self.fleet]}], instance_ids)
