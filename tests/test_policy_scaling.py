"""Scaling (issue 4): hysteresis, cool-down and the marginal-efficiency rule; action and reason."""

from __future__ import annotations

import pytest

from fleetd.policy.model import Drain, Launch, NodePhase
from fleetd.policy.observation import Observation
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B, config, node, offer

CFG = config(
    fleet={"min_nodes": 1, "max_nodes": 4},
    scaling={
        "min_marginal_efficiency": 0.7,
        "efficiency_hysteresis": 0.1,
        "scale_up_util_pct": 80.0,
        "scale_down_util_pct": 30.0,
        "cooldown_s": 300.0,
    },
    budget={"total_usd": 1000.0, "max_usd_per_hour": 100.0},
)
OFFERS = (offer(A, 0.4), offer(B, 0.4))  # every node costs the same: per dollar == per node


def fleet(n: int, util: float) -> tuple:
    return tuple(node(f"i-{k}", (A, B)[k % 2], util=util) for k in range(n))


def observe(n=2, util=90.0, throughput=None, target=2, since=1000.0, **kw) -> Observation:
    return Observation(
        nodes=fleet(n, util),
        offers=OFFERS,
        throughput_by_nodes=throughput or {},
        target_nodes=target,
        last_scaling_at=NOW - since,
        **kw,
    )


UP, DOWN, HOLD = "up", "down", "hold"


@pytest.mark.parametrize(
    ("case", "obs", "move", "target", "reason"),
    [
        (
            "next node measured efficient enough",
            observe(throughput={1: 1.0, 2: 1.9, 3: 2.75}),
            UP,
            3,
            "scale up 2->3: GPUs busy (90%) and node 3 adds 0.850 steps/s (measured at 3 nodes) "
            "= 89% of the average throughput per dollar >= min_marginal_efficiency 70%",
        ),
        (
            "next node measured below the rule",
            observe(throughput={1: 1.0, 2: 1.9, 3: 2.4}),
            HOLD,
            2,
            "holding at 2: node 3 would add 0.500 steps/s (measured at 3 nodes) = 53% of the "
            "average throughput per dollar < min_marginal_efficiency 70%",
        ),
        (
            "unmeasured next node assumed like the last",
            observe(throughput={1: 1.0, 2: 1.9}),
            UP,
            3,
            "node 3 adds 0.900 steps/s (assumed equal to node 2's measured gain) = 95%",
        ),
        (
            "nothing measured beyond: explore",
            observe(throughput={2: 1.9}),
            UP,
            3,
            "no measurement beyond 2 nodes yet: exploring",
        ),
        (
            "last node inefficient: scale down",
            observe(throughput={1: 1.0, 2: 1.2}),
            DOWN,
            1,
            "scale down 2->1: node 2 adds 0.200 steps/s = 33% of the average throughput per "
            "dollar, below 63% (min_marginal_efficiency 70% less 10% hysteresis)",
        ),
        (
            "inside the hysteresis band: neither up nor down",
            observe(throughput={1: 1.0, 2: 1.5}),
            HOLD,
            2,
            "node 3 would add 0.500 steps/s (assumed equal to node 2's measured gain) = 67%",
        ),
        (
            "idle GPUs",
            observe(util=20.0, throughput={1: 1.0, 2: 1.9}),
            DOWN,
            1,
            "scale down 2->1: mean GPU utilisation 20% < scale_down_util_pct 30% (idle)",
        ),
        (
            "utilisation between thresholds",
            observe(util=50.0, throughput={1: 1.0, 2: 1.9}),
            HOLD,
            2,
            "mean GPU utilisation 50% is between scale_down_util_pct 30% and scale_up_util_pct 80%",
        ),
        (
            "cool-down after a change",
            observe(throughput={1: 1.0, 2: 1.9}, since=100.0),
            HOLD,
            2,
            "holding at 2: cool-down, last change 100 s ago (cooldown_s=300)",
        ),
        (
            "cool-down also holds a scale-down",
            observe(util=10.0, since=299.0),
            HOLD,
            2,
            "cool-down, last change 299 s ago",
        ),
        (
            "at max_nodes",
            observe(n=4, target=4, throughput={3: 2.8, 4: 3.7}),
            HOLD,
            4,
            "holding at max_nodes=4: GPUs busy (90%)",
        ),
        (
            "budget at warn: no scale-up",
            observe(throughput={1: 1.0, 2: 1.9}, spent_usd=800.0),
            HOLD,
            2,
            "holding at 2: no scale-up while the budget is at warn",
        ),
        (
            "budget hysteresis: one more node would itself reach warn_at",
            observe(throughput={1: 1.0, 2: 1.9}, spent_usd=799.0),
            HOLD,
            2,
            "holding at 2: one more node ($0.400/h) would bring the forecast to 80% >= warn_at 80%",
        ),
        (
            "fleet not at its target yet",
            observe(n=2, target=3, throughput={1: 1.0, 2: 1.9}),
            HOLD,
            3,
            "judging scale only once the fleet is at its target and reporting",
        ),
        (
            "target outside new config bounds",
            observe(n=2, target=6),
            DOWN,
            4,
            "target 6 is outside [min_nodes=1, max_nodes=4]: now 4",
        ),
    ],
)
def test_scaling_decisions(case, obs, move, target, reason) -> None:
    result = plan(obs, CFG, NOW)
    assert result.target_nodes == target, case
    assert any(reason in n for n in result.notes), (case, result.notes)
    launches, drains = result.of_type(Launch), result.of_type(Drain)
    kept = len(obs.nodes)
    if move == UP:
        assert [a.count for a in launches] == [target - kept]
        assert drains == ()
    elif move == DOWN and target < kept:
        assert len(drains) == kept - target and launches == ()
        assert drains[0].reason.startswith(f"scaling to {target} nodes: removing")
    else:
        assert drains == ()
        assert [a.count for a in launches] == ([target - kept] if target > kept else [])


def test_cool_down_never_delays_replacing_a_lost_node() -> None:
    obs = observe(n=1, target=2, since=10.0)
    result = plan(obs, CFG, NOW)
    (launch,) = result.of_type(Launch)
    assert launch.count == 1 and launch.reason.startswith("capacity: buy 1 spot node(s)")


def test_a_straggler_is_drained_and_replaced() -> None:
    nodes = (node("i-0", sps=1.0), node("i-1", B, sps=0.3), node("i-2", sps=1.1))
    obs = Observation(
        nodes=nodes,
        offers=OFFERS,
        target_nodes=3,
        last_scaling_at=NOW - 10,
        throughput_by_nodes={3: 2.4},
    )
    result = plan(obs, CFG, NOW)
    (drain,) = result.of_type(Drain)
    assert drain.instance_id == "i-1"
    assert drain.reason == (
        "i-1 is straggling: 0.300 steps/s (averaged over its reports) < straggler_ratio 50% of the median 1.000; replacing it"
    )
    (launch,) = result.of_type(Launch)
    assert launch.count == 1


def test_pending_nodes_count_toward_the_target() -> None:
    booting = node("i-9", phase=NodePhase.PENDING, seen=None, launched_at=NOW - 60)
    obs = Observation(nodes=fleet(1, 90.0) + (booting,), offers=OFFERS, target_nodes=2)
    assert plan(obs, CFG, NOW).of_type(Launch) == ()


def test_no_straggler_verdict_while_a_new_node_is_settling() -> None:
    # Right after a join every node restarts its workers: a low rate then is the re-form pause,
    # not a slow machine.
    newcomer = node("i-3", sps=1.0, launched_at=NOW - 30)
    nodes = (node("i-0", sps=1.0), node("i-1", B, sps=0.3), node("i-2", sps=1.1), newcomer)
    obs = Observation(
        nodes=nodes,
        offers=OFFERS,
        target_nodes=4,
        last_scaling_at=NOW - 10,
        throughput_by_nodes={4: 3.0},
    )
    result = plan(obs, CFG, NOW)
    assert result.of_type(Drain) == ()
    later = plan(obs, CFG, NOW + CFG.scaling.straggler_settle_s)
    (drain,) = later.of_type(Drain)
    assert drain.instance_id == "i-1" and "is straggling" in drain.reason
