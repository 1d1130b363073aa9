"""An in-memory :class:`~fleetd.adapters.ec2.Ec2Api` for the simulator and unit tests.

It keeps the contract of the real adapter (fleet ownership, launch tokens, per-pool capacity
failures as data, AwsError for call-level failures) without any network, on the caller's clock,
so the reconcile loop can be driven through a scenario and its action sequence compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from fleetd.adapters.aws_errors import AwsError
from fleetd.adapters.ec2 import Ec2Instance, LaunchResult, LaunchSpec, PoolFailure
from fleetd.policy.model import PoolId


@dataclass
class FakeEc2:
    clock: Callable[[], float]
    instances: dict[str, Ec2Instance] = field(default_factory=dict)
    foreign: set[str] = field(default_factory=set)  # ids that exist but are not this fleet's
    no_capacity: dict[PoolId, str] = field(default_factory=dict)  # pool -> error code
    fail_next: dict[str, list[AwsError]] = field(default_factory=dict)  # operation -> errors to raise
    calls: list[tuple[str, object]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def _maybe_fail(self, operation: str) -> None:
        queue = self.fail_next.get(operation)
        if queue:
            raise queue.pop(0)

    async def list_instances(self) -> list[Ec2Instance]:
        self.calls.append(("DescribeInstances", None))
        self._maybe_fail("DescribeInstances")
        return list(self.instances.values())

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        self.calls.append(("CreateFleet", spec))
        self._maybe_fail("CreateFleet")
        mine = [i for i in self.instances.values() if i.launch_token == spec.token and i.state != "terminated"]
        if mine:
            return LaunchResult(spec.token, tuple(mine), already_launched=True)
        failures = tuple(
            PoolFailure(p, "capacity", self.no_capacity[p], "no capacity (fake)")
            for p in spec.pools
            if p in self.no_capacity
        )
        open_pools = [p for p in spec.pools if p not in self.no_capacity]
        launched: list[Ec2Instance] = []
        if open_pools:
            for _ in range(spec.count):
                iid = f"i-{next(self._ids):017x}"
                inst = Ec2Instance(iid, open_pools[0], spec.market, "running", self.clock(), spec.token)
                self.instances[iid] = inst
                launched.append(inst)
        return LaunchResult(spec.token, tuple(launched), failures)

    async def terminate(self, instance_ids: Sequence[str]) -> list[str]:
        self.calls.append(("TerminateInstances", tuple(instance_ids)))
        self._maybe_fail("TerminateInstances")
        done = [i for i in instance_ids if i in self.instances and i not in self.foreign]
        for iid in done:
            self.instances[iid] = replace(self.instances[iid], state="terminated")
        return done

    def interrupt(self, instance_id: str, reason: str = "Server.SpotInstanceTermination") -> None:
        """AWS reclaims a node (fleetd is not asked)."""
        self.instances[instance_id] = replace(self.instances[instance_id], state="terminated", state_reason=reason)

    def live(self) -> list[Ec2Instance]:
        return [i for i in self.instances.values() if i.live]

    def count(self, operation: str) -> int:
        return sum(1 for op, _ in self.calls if op == operation)
