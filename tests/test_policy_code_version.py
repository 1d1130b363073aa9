"""One world, one version of the job's code (fleetd/policy/stages/code_version.py): when the job's
version changes, every node on the old one is drained in the same pass and its replacement is
bought from the template that carries the new one."""

from __future__ import annotations

from fleetd.policy.model import Drain, Launch, LaunchPurpose
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B, C, config, node, offer

OLD, NEW = "a" * 64, "b" * 64
CFG = config(fleet={"min_nodes": 2, "max_nodes": 4}, budget={"total_usd": 100.0, "max_usd_per_hour": 20.0})
OFFERS = (offer(A, 0.40), offer(B, 0.42), offer(C, 0.45))


def observe(*nodes, code_digest: str = NEW) -> Observation:  # type: ignore[no-untyped-def]
    return Observation(nodes=nodes, offers=OFFERS, target_nodes=2, last_scaling_at=NOW - 10, code_digest=code_digest)


def test_every_node_on_the_old_version_drains_and_is_replaced_at_once() -> None:
    result = plan(observe(node("i-1", A, code_digest=OLD), node("i-2", B, code_digest=OLD)), CFG, NOW)
    drains = result.of_type(Drain)
    assert sorted(d.instance_id for d in drains) == ["i-1", "i-2"]
    assert "runs the job's code version aaaaaaaaaaaa, the job's is now bbbbbbbbbbbb" in drains[0].reason
    (launch,) = result.of_type(Launch)
    assert launch.count == 2 and launch.purpose is LaunchPurpose.CAPACITY


def test_nodes_on_the_version_or_of_unknown_version_stay() -> None:
    current, unknown = node("i-1", A, code_digest=NEW), node("i-2", B)
    assert plan(observe(current, unknown), CFG, NOW).of_type(Drain) == ()
    # Code baked into the image (no version anywhere): nothing to compare.
    assert plan(observe(node("i-1", A, code_digest=OLD), code_digest=""), CFG, NOW).of_type(Drain) == ()


def test_a_noticed_node_on_the_old_version_is_drained_once() -> None:
    noticed = node("i-1", A, code_digest=OLD, notice_at=NOW - 5, notice_deadline=NOW + 100)
    drains = plan(observe(noticed, node("i-2", B, code_digest=NEW)), CFG, NOW).of_type(Drain)
    assert [d.instance_id for d in drains] == ["i-1"] and "interruption notice" in drains[0].reason
