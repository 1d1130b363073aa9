"""The reclaim-wave wait of a deadline job (fleetd/policy/deadline.py ``can_wait_s``,
fleetd/policy/stages/buying.py ``wave_pools_to_buy_now``): pure planner tests."""

from __future__ import annotations

from types import MappingProxyType

from fleetd.policy.model import Launch, LaunchPurpose, Market
from fleetd.policy.observation import Observation, PoolStats
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B
from tests.test_policy_deadline import H, _durable, _obs, deadline_cfg


def _lost_in_a_wave(slack_s: float) -> tuple[Observation, object]:
    """One node, its spot node lost 30 s into a reclaim wave of both pools (90 s left); 5 h of
    work left at a measured 1 step/s, d = 720 s, ``slack_s`` of slack."""
    cfg = deadline_cfg(1, due_h=(5 * H + slack_s) / H, total_steps=6 * 3600)
    wave = tuple(PoolStats(p, notices=1, last_notice_at=NOW - 30) for p in (A, B))
    obs = _durable(_obs(0, 1, 0, started_h=3, rate=1.0, stats=wave), 3600)
    obs = Observation(
        **{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "throughput_by_nodes": MappingProxyType({1: 1.0})}
    )
    return obs, cfg


def test_a_reclaim_wave_is_waited_out_while_the_wait_leaves_the_net_s_margin() -> None:
    # 2d = 1,440 s must be left at the first pass after the wait (90 s, and up to one reconcile
    # interval, 10 s): 1,560 s of slack leaves 1,460 s.
    obs, cfg = _lost_in_a_wave(1560.0)
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and not result.deadline.safety_net and result.deadline.on_demand_now
    assert result.of_type(Launch) == ()
    assert any("reclaim wave ends in 90 s" in n for n in result.notes)


def test_a_wait_that_would_carry_the_job_into_the_safety_net_buys_spot_in_the_wave_s_pool() -> None:
    # 1,500 s of slack: outside the net (>= 2d = 1,440 s), but the wait and the pass after it
    # (100 s) would leave less than 2d, and the net would then finish the job on on-demand. Measured on the g4dn
    # trace (bench/deadline.py, one node, due 7.5 h, d = 0.3 h, offset 3.23 h): waiting out a
    # wave with 2d + 120 s of slack cost 5 h on on-demand ($3.04 against UP's $1.36).
    obs, cfg = _lost_in_a_wave(1500.0)
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and not result.deadline.safety_net
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.SPOT and launch.purpose is LaunchPurpose.CAPACITY
    assert "reclaim wave under way, but waiting 90 s for it" in launch.reason
    # Inside the net (slack < 2d) no new spot; the net's own rule waits for the wave while a
    # changeover, the reserve and the stalls are left after it, else pays on-demand at once.
    obs, cfg = _lost_in_a_wave(1400.0)
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and result.deadline.safety_net
    assert result.of_type(Launch) == () and any("reclaim wave ends in 90 s" in n for n in result.notes)
    obs, cfg = _lost_in_a_wave(950.0)
    (launch,) = plan(obs, cfg, NOW).of_type(Launch)
    assert launch.market is Market.ON_DEMAND and launch.purpose is LaunchPurpose.ON_DEMAND_FALLBACK
