"""Must-show (issue 16): a rebalance recommendation with no notice expires, against moto server.

The real path: the EventBridge/MQTT event lands in the controller's NodeRegistry, the reconcile
loop (real aiobotocore EC2 adapter, real planner) pre-buys a node in another pool through
CreateFleet, and once ``rebalance.recommendation_expiry_s`` passes with no notice it terminates
that extra node in EC2, leaving the once-risky node training.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fleetd.intake.events import RebalanceRecommended
from fleetd.intake.registry import NodeRegistry
from fleetd.policy.model import Launch, LaunchPurpose, Terminate
from fleetd.policy.planner import plan
from fleetd.reconcile.build import build_reconciler
from tests.reconcile_support import Cloud, FakeClock, pools_of

WINDOW_S = 300.0


async def test_rebalance_with_no_notice_releases_the_extra_node_after_the_window(cloud: Cloud, tmp_path: Path) -> None:
    # EC2 (moto) stamps LaunchTime with the real clock, in whole seconds, while this test's clock
    # jumps by reconcile intervals. prebought_for takes only nodes launched after the advice (and
    # then by the launch's recorded purpose), so the test puts the recommendation strictly between
    # the first launches and the pre-buy in real time, as a real recommendation is.
    clock = FakeClock(time.time() - 600.0)
    base = cloud.config(tmp_path, nodes=2, boot_timeout_s=7200.0)  # nodes here run no agent
    cfg = base.model_copy(update={"rebalance": base.rebalance.model_copy(update={"recommendation_expiry_s": WINDOW_S})})
    registry = NodeRegistry(clock=clock)
    async with cloud.client() as client:
        built = await build_reconciler(cfg, client, planner=plan, clock=clock, observer=registry)
        r = built.reconciler
        try:

            async def passes(n: int) -> list:
                out = []
                for _ in range(n):
                    out.append(await r.run_pass())
                    clock.advance(cfg.fleet.reconcile_interval_s)
                return out

            await passes(3)
            first = await cloud.instances()
            assert len(first) == 2
            risky = first[0]
            risky_id = risky["InstanceId"]
            risky_pool = pools_of([risky])[0]

            # AWS advises a rebalance for one node (as the EventBridge intake delivers it).
            await asyncio.sleep(1.1)
            clock.advance(time.time() - clock())
            registry.apply(
                RebalanceRecommended(
                    risky_id,
                    notice_time=clock(),
                    source="eventbridge",
                    received_at=clock(),
                    dedup_key="eventbridge:reb-1",
                )
            )
            await asyncio.sleep(1.1)
            reports = await passes(3)
            prebuys = [
                o
                for rep in reports
                for o in rep.outcomes
                if isinstance(o.action, Launch) and o.action.purpose is LaunchPurpose.REBALANCE_PREBUY
            ]
            assert [o.status for o in prebuys] == ["done"] and prebuys[0].action.count == 1
            assert risky_pool not in prebuys[0].action.pools  # bought away from the risk
            live = await cloud.instances()
            assert len(live) == 3
            extra = ({i["InstanceId"] for i in live} - {i["InstanceId"] for i in first}).pop()
            # Each node carries why it was bought: the state's launch intent, joined by its tag.
            seen = {n.instance_id: n.launch_purpose for n in reports[-1].observation.nodes}
            assert seen[extra] is LaunchPurpose.REBALANCE_PREBUY, seen
            assert {seen[i["InstanceId"]] for i in first} == {LaunchPurpose.CAPACITY}, seen

            # Inside the window: the extra node stays (it would replace the risky one at a notice).
            clock.advance(WINDOW_S - 60)
            reports = await passes(2)
            assert not [o for rep in reports for o in rep.outcomes if isinstance(o.action, Terminate)]
            assert len(await cloud.instances()) == 3

            # No notice came: past the window the extra node is released in EC2, the risky one kept.
            clock.advance(60)
            reports = await passes(3)
            terminated = [o for rep in reports for o in rep.outcomes if isinstance(o.action, Terminate)]
            assert [(o.action.instance_id, o.status) for o in terminated] == [(extra, "done")]
            assert "pre-bought for a rebalance recommendation that expired" in terminated[0].action.reason
            notes = [n for rep in reports if rep.plan is not None for n in rep.plan.notes]
            assert any("expired: no notice within recommendation_expiry_s=300" in n for n in notes)
            live = {i["InstanceId"] for i in await cloud.instances()}
            assert live == {i["InstanceId"] for i in first} and risky_id in live
            # And nothing is bought back: the fleet is at its target, no new pre-buy for old advice.
            assert len([o for rep in reports for o in rep.outcomes if isinstance(o.action, Launch)]) == 0
        finally:
            await built.close()
