"""The deadline rule (fleetd/policy/deadline.py) and the planner acting on it: pure unit tests."""

from __future__ import annotations

from datetime import UTC, datetime
from types import MappingProxyType

import pytest

from fleetd.policy.deadline import DeadlineInputs, decide, steps_per_s_at
from fleetd.policy.model import Launch, LaunchPurpose, Market
from fleetd.policy.observation import Observation, PoolStats
from fleetd.policy.planner import plan
from tests.policy_fixtures import NOW, A, B, config, node, offer

H = 3600.0


def inputs(done_h: float, now_h: float, d_h: float, full_on_spot: bool = False, rate: float | None = 1.0):
    # 6 h of work (1 step/s) due 9 h after the start at 0.
    return DeadlineInputs(
        deadline_at=9 * H,
        started_at=0.0,
        total_steps=6 * H,
        done_steps=done_h * H,
        steps_per_s=rate,
        changeover_s=d_h * H,
        full_on_spot=full_on_spot,
    ), now_h * H


@pytest.mark.parametrize("d_h", [0.05, 0.2, 0.3, 0.5])
def test_ahead_of_the_line_waits_for_spot_at_every_changeover(d_h) -> None:
    call = decide(*inputs(done_h=3.0, now_h=3.0, d_h=d_h))  # line: 2 h by 3 h
    assert not call.on_demand_now and call.spot_allowed and not call.safety_net
    assert call.on_demand_not_needed == (3.0 >= 6 * (3.0 + 2 * d_h) / 9)


@pytest.mark.parametrize(("od_nodes", "nodes", "released"), [(1, 1, False), (2, 4, True), (4, 4, False), (0, 4, False)])
def test_a_fleet_keeps_on_demand_for_two_changeovers_of_the_nodes_that_change_over(od_nodes, nodes, released) -> None:
    # Line: 6 h of work by 9 h; at 3.3 h it stands at 2.2 h and the job has done 2.4 h. d = 0.2 h:
    # UP's margin 2d asks for ep(3.7 h) = 2.47 h (not yet); 2 of 4 nodes on on-demand: 2d x 2/4
    # asks for ep(3.5 h) = 2.33 h (met). One node, all four or none on on-demand: the full 2d.
    i, now = inputs(done_h=2.4, now_h=3.3, d_h=0.2)
    i = DeadlineInputs(**{**{f: getattr(i, f) for f in i.__slots__}, "nodes": nodes, "on_demand_nodes": od_nodes})
    call = decide(i, now)
    assert not call.on_demand_now and call.spot_allowed
    assert call.on_demand_not_needed is released
    if nodes > 1 and od_nodes:
        assert f"x {od_nodes}/{nodes} on-demand nodes" in call.reason


@pytest.mark.parametrize("d_h", [0.05, 0.2, 0.3, 0.5])
def test_behind_the_line_buys_on_demand_but_still_takes_spot(d_h) -> None:
    call = decide(*inputs(done_h=1.0, now_h=3.0, d_h=d_h))
    assert call.on_demand_now and call.spot_allowed and not call.safety_net
    assert "behind the uniform-progress line" in call.reason


@pytest.mark.parametrize("d_h", [0.3, 0.5])
def test_safety_net_at_large_changeover_finishes_on_demand(d_h) -> None:
    # 4 h of work left, 4.5 h left: < 4 h + 2d for d >= 0.3 h (0.6 h), so no more spot.
    call = decide(*inputs(done_h=2.0, now_h=4.5, d_h=d_h))
    assert call.safety_net and call.on_demand_now and not call.spot_allowed
    # The same job running full on spot keeps its spot nodes (UP: spot is never left).
    call = decide(*inputs(done_h=2.0, now_h=4.5, d_h=d_h, full_on_spot=True))
    assert not call.safety_net


def test_the_safety_net_is_not_entered_while_the_changeover_still_fits() -> None:
    call = decide(*inputs(done_h=2.0, now_h=4.5, d_h=0.2))  # 4.5 h >= 4 h + 0.4 h
    assert not call.safety_net and call.on_demand_now  # behind the line: 2 h < 3 h


def test_unknown_throughput_leaves_only_the_line_and_done_is_done() -> None:
    call = decide(*inputs(done_h=0.0, now_h=8.9, d_h=0.2, rate=None))
    assert call.on_demand_now and not call.safety_net
    call = decide(*inputs(done_h=6.0, now_h=8.0, d_h=0.2))
    assert not call.on_demand_now and call.on_demand_not_needed


def test_wake_times_are_when_the_idle_job_falls_behind_and_the_safety_net_begins() -> None:
    call = decide(*inputs(done_h=3.0, now_h=3.0, d_h=0.2))
    assert call.wake_at == pytest.approx((4.5 * H + 1e-3, (9 - 3 - 0.4) * H + 1e-3))


def test_throughput_at_the_target_is_never_overstated() -> None:
    measured = MappingProxyType({2: 1.9, 8: 6.0})
    assert steps_per_s_at(measured, 8) == 6.0
    assert steps_per_s_at(measured, 4) == pytest.approx(1.9 * 2 * 0.9)  # from 2, 0.9 per doubling
    assert steps_per_s_at(measured, 1) == pytest.approx(0.95)  # 2 nodes' rate per node
    assert steps_per_s_at(MappingProxyType({8: 6.0}), 4) == pytest.approx(3.0)
    assert steps_per_s_at({}, 4) is None


# --- the planner with a deadline (one node and many) ----------------------------------------
# Fresh capacity errors (10 s old at the default 600 s TTL): too young for a probe of spot.
NO_SPOT = tuple(PoolStats(p, capacity_error_until=NOW + 590) for p in (A, B))


def deadline_cfg(nodes: int, due_h: float, total_steps: int, d_s: float = 720.0, on_demand: str = "deadline"):
    return config(
        fleet={"min_nodes": 1, "max_nodes": nodes},
        capacity={"on_demand": on_demand},
        job={"deadline": datetime.fromtimestamp(NOW + due_h * H, UTC), "total_steps": total_steps, "changeover_s": d_s},
    )


def _obs(running: int, target: int, step: int, started_h: float, rate: float, stats=NO_SPOT, since=None):
    nodes = tuple(node(f"i-{i}", step=step) for i in range(running))
    return Observation(
        nodes=nodes,
        offers=(offer(A, 0.4), offer(B, 0.4)),
        pool_stats=stats,
        target_nodes=target,
        last_scaling_at=NOW,
        throughput_by_nodes=MappingProxyType({running: rate} if running else {}),
        job_started_at=NOW - started_h * H,
        spot_unavailable_since=since,
    )


def test_single_node_behind_the_line_buys_on_demand_at_once_without_spot_wait() -> None:
    # 6 h of work due 9 h after the start; 3 h in, 1 h done; the spot node was lost.
    cfg = deadline_cfg(1, due_h=6, total_steps=6 * 3600)
    obs = _obs(0, 1, 0, started_h=3, rate=1.0)
    obs = Observation(
        **{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "last_durable_checkpoint_step": 3600}
    )
    result = plan(obs, cfg, NOW)
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.ON_DEMAND and launch.purpose is LaunchPurpose.ON_DEMAND_FALLBACK
    assert "behind the uniform-progress line" in launch.reason
    assert result.deadline is not None and result.deadline.on_demand_now


def _durable(obs: Observation, step: int) -> Observation:
    return Observation(
        **{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "last_durable_checkpoint_step": step}
    )


def test_behind_the_line_an_old_capacity_error_is_tried_again_before_paying_on_demand() -> None:
    cfg = deadline_cfg(1, due_h=6, total_steps=6 * 3600)
    aged = (PoolStats(A, capacity_error_until=NOW + 300), PoolStats(B, capacity_error_until=NOW + 590))
    result = plan(_durable(_obs(0, 1, 0, started_h=3, rate=1.0, stats=aged), 3600), cfg, NOW)
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.SPOT and launch.pools == (A,)  # B's error is 10 s old: not yet
    assert launch.purpose is LaunchPurpose.CAPACITY
    assert "probe before paying on-demand" in launch.reason and "spot_probe_s 60 s" in launch.reason
    # A failed probe leaves a fresh error: the next pass pays on-demand as before.
    fresh = (PoolStats(A, capacity_error_until=NOW + 600), PoolStats(B, capacity_error_until=NOW + 590))
    (launch,) = plan(_durable(_obs(0, 1, 0, started_h=3, rate=1.0, stats=fresh), 3600), cfg, NOW).of_type(Launch)
    assert launch.market is Market.ON_DEMAND


def test_inside_the_safety_net_no_probe_on_demand_at_once() -> None:
    # 5 h of work left, 5.2 h to the deadline, d = 0.2 h: inside the net (< work + 2d).
    cfg = deadline_cfg(1, due_h=5.2, total_steps=6 * 3600)
    aged = tuple(PoolStats(p, capacity_error_until=NOW + 1) for p in (A, B))  # 599 s old
    obs = _durable(_obs(0, 1, 0, started_h=3, rate=1.0, stats=aged), 3600)
    obs = Observation(
        **{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "throughput_by_nodes": MappingProxyType({1: 1.0})}
    )  # measured before the loss
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and result.deadline.safety_net and not result.deadline.spot_allowed
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.ON_DEMAND


def test_the_probe_age_is_capped_at_the_ttl_and_configurable() -> None:
    cfg = deadline_cfg(1, due_h=6, total_steps=6 * 3600)
    cfg = cfg.model_copy(update={"capacity": cfg.capacity.model_copy(update={"spot_probe_s": 400.0})})
    aged = tuple(PoolStats(p, capacity_error_until=NOW + 300) for p in (A, B))  # 300 s old < 400
    (launch,) = plan(_durable(_obs(0, 1, 0, started_h=3, rate=1.0, stats=aged), 3600), cfg, NOW).of_type(Launch)
    assert launch.market is Market.ON_DEMAND


def test_single_node_ahead_waits_for_spot_and_no_deadline_never_buys_on_demand() -> None:
    cfg = deadline_cfg(1, due_h=6, total_steps=6 * 3600)
    obs = _obs(0, 1, 0, started_h=3, rate=1.0)
    obs = Observation(
        **{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "last_durable_checkpoint_step": 3 * 3600}
    )
    result = plan(obs, cfg, NOW)
    assert result.of_type(Launch) == ()
    assert any("spot only" in n for n in result.notes)
    # No deadline at all, spot short for an hour: still no on-demand under the default policy.
    plain = config(fleet={"min_nodes": 1, "max_nodes": 1})
    result = plan(_obs(0, 1, 0, started_h=3, rate=1.0, since=NOW - 3600), plain, NOW)
    assert result.of_type(Launch) == () and result.deadline is None


def test_multi_node_safety_net_fills_the_shortfall_with_on_demand_and_buys_no_spot() -> None:
    # 4 nodes, 3 training on spot at 3 steps/s; 40,000 steps left, 3.4 h to go: with d = 0.3 h
    # the work at 4 nodes (~3.7 h at the conservative 4/3 x 3 = 4 steps/s... = 2.8 h) + 0.6 h.
    cfg = deadline_cfg(4, due_h=3.4, total_steps=80_000, d_s=0.3 * H)
    spot_ok = (PoolStats(A), PoolStats(B))
    obs = _obs(3, 4, 40_000, started_h=6, rate=3.0, stats=spot_ok)
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and result.deadline.safety_net
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.ON_DEMAND and launch.count == 1
    assert any("no new spot: deadline safety net" in n for n in result.notes)


def test_never_means_never_even_for_a_deadline() -> None:
    cfg = deadline_cfg(1, due_h=1, total_steps=6 * 3600, on_demand="never")
    result = plan(_obs(0, 1, 0, started_h=8, rate=1.0), cfg, NOW)
    assert result.of_type(Launch) == ()
    assert any('capacity.on_demand = "never"' in n for n in result.notes)


@pytest.mark.parametrize(
    ("nodes", "slack_h", "swap"), [(1, 0.55, False), (1, 0.7, True), (4, 0.7, True), (4, 0.55, False), (4, 0.3, False)]
)
def test_inside_the_safety_net_a_make_before_break_swap_needs_slack_for_losing_every_spot_node(
    nodes, slack_h, swap
) -> None:
    # d = 0.5 h: the safety net is below 1 h of slack; a swap needs d + d / 4 of it, for a fleet
    # too (a reclaim wave can take every spot node at once: the fleet stops for d).
    i = DeadlineInputs(
        deadline_at=10 * H,
        started_at=0.0,
        total_steps=(10 - 4 - slack_h) * H,
        done_steps=0.0,
        steps_per_s=1.0,
        changeover_s=0.5 * H,
        full_on_spot=False,
        nodes=nodes,
    )
    call = decide(i, 4 * H)
    assert call.safety_net and not call.spot_allowed
    assert call.swap_to_spot is swap


def test_planner_swaps_on_demand_for_spot_inside_the_safety_net_only_when_the_slack_allows() -> None:
    # 4 nodes on on-demand at 4 steps/s, 0.5 h changeover, spot offered again.
    def result(slack_h: float):
        left_h = 3.0
        total = int((left_h - slack_h) * H * 4) + 1000
        cfg = deadline_cfg(4, due_h=left_h, total_steps=total, d_s=0.5 * H)
        nodes = tuple(node(f"od-{i}", market=Market.ON_DEMAND, price=1.0, step=1000) for i in range(4))
        obs = Observation(
            nodes=nodes,
            offers=(offer(A, 0.4),),
            target_nodes=4,
            last_scaling_at=NOW,
            throughput_by_nodes=MappingProxyType({4: 4.0}),
            job_started_at=NOW - 6 * H,
        )
        return plan(obs, cfg, NOW)

    swapping = result(0.7)  # >= 0.5 + 0.125 h (losing every spot node again, and a reserve)
    assert swapping.deadline.safety_net and swapping.deadline.swap_to_spot
    (launch,) = swapping.of_type(Launch)
    assert launch.market is Market.SPOT and launch.purpose is LaunchPurpose.RETURN_TO_SPOT
    holding = result(0.5)  # one node's loss (0.5 / 4 h) would fit; a wave taking all four would not
    assert holding.deadline.safety_net and not holding.deadline.swap_to_spot
    assert holding.of_type(Launch) == ()


def test_a_deadline_needs_its_work_and_is_read_as_utc_epoch_seconds() -> None:
    from fleetd.config import FleetdConfig

    cfg = FleetdConfig(job={"deadline": "2026-12-01T18:00:00Z", "total_steps": 100})
    assert cfg.job.deadline_at() == datetime(2026, 12, 1, 18, tzinfo=UTC).timestamp()
    assert cfg.capacity.on_demand == "deadline"
    with pytest.raises(ValueError, match="needs job.total_steps"):
        FleetdConfig(job={"deadline": "2026-12-01T18:00:00Z"})
    with pytest.raises(ValueError):
        FleetdConfig(capacity={"instance_types": ["g5.xlarge"], "on_demand": "sometimes"})


def test_before_any_measurement_the_operators_throughput_estimate_sets_the_safety_net() -> None:
    # 6 h of work due in 6.2 h, nothing trained yet (the first spot node was lost before it
    # trained). With job.steps_per_s the rule knows the work left (6 h + 2d > 6.2 h): safety net,
    # on-demand now. Without it, only the line decides (behind it: on-demand too, but spot stays
    # allowed and no safety net can start before a measurement).
    def cfg(sps):
        job = {
            "deadline": datetime.fromtimestamp(NOW + 6.2 * H, UTC),
            "total_steps": 6 * 3600,
            "changeover_s": 720.0,
            **({"steps_per_s": sps} if sps else {}),
        }
        return config(fleet={"min_nodes": 1, "max_nodes": 1}, capacity={"on_demand": "deadline"}, job=job)

    obs = _obs(0, 1, 0, started_h=1, rate=1.0)
    known = plan(obs, cfg(1.0), NOW).deadline
    assert known is not None and known.safety_net and not known.spot_allowed
    unknown = plan(obs, cfg(None), NOW).deadline
    assert unknown is not None and not unknown.safety_net and unknown.spot_allowed and unknown.slack_s is None


def test_while_the_first_nodes_boot_the_rule_does_not_wake_the_planner_at_once() -> None:
    # Zero slack while the first node boots: time left and work left (with the boot) shrink
    # together, so the safety net's crossing never comes by waiting (it made the simulator pass
    # every millisecond); the boot's end wakes the planner instead.
    i = DeadlineInputs(
        deadline_at=27000.0,
        started_at=0.0,
        total_steps=21600.0,
        done_steps=0.0,
        steps_per_s=1.0,
        changeover_s=1800.0,
        full_on_spot=False,
        pending_s=1797.0,
    )
    call = decide(i, 3.0)
    assert not call.safety_net
    assert all(t > 3.0 + 60 for t in call.wake_at)


def _ahead_fleet(nodes: int, od: int = 1):
    """A job far ahead of its line with ``od`` of its nodes on on-demand, spot offered."""
    members = tuple(node(f"od-{i}", market=Market.ON_DEMAND, price=1.0, step=5 * 3600) for i in range(od)) + tuple(
        node(f"sp-{i}", step=5 * 3600) for i in range(nodes - od)
    )
    cfg = deadline_cfg(nodes, due_h=6, total_steps=6 * 3600 * nodes)
    obs = Observation(
        nodes=members,
        offers=(offer(A, 0.4), offer(B, 0.4)),
        target_nodes=nodes,
        last_scaling_at=NOW - 3600,
        throughput_by_nodes=MappingProxyType({nodes: float(nodes)}),
        job_started_at=NOW - 3 * H,
        last_durable_checkpoint_step=5 * 3600 * nodes,
    )
    return plan(obs, cfg, NOW)


def test_ahead_one_node_idles_its_on_demand_node_and_a_fleet_keeps_what_holds_the_pace() -> None:
    single = _ahead_fleet(1)
    assert single.deadline is not None and single.deadline.on_demand_not_needed
    assert single.deadline.on_demand_keep == 0  # UP: the one node idles until spot returns
    assert any("od-0" in getattr(a, "reason", "") and "not needed" in a.reason for a in single.actions)
    # 4 nodes, 1 on spot, 3 on on-demand; the line's pace is 6 h x 4 nodes over 9 h = 2.67 nodes'
    # worth: 2 whole nodes hold it, so one on-demand node stays (back to spot make-before-break)
    # and two go now.
    fleet = _ahead_fleet(4, od=3)
    assert fleet.deadline is not None and fleet.deadline.on_demand_not_needed
    assert fleet.deadline.on_demand_keep == 1 and "keeping 1 on-demand node" in fleet.deadline.reason
    released = [a for a in fleet.actions if "not needed" in getattr(a, "reason", "")]
    assert len(released) == 2
    launches = fleet.of_type(Launch)
    assert launches and all(launch.market is Market.SPOT for launch in launches)
    assert any(launch.purpose is LaunchPurpose.RETURN_TO_SPOT for launch in launches)


def test_the_on_demand_kept_ahead_of_the_line_holds_the_pace_in_whole_nodes() -> None:
    from fleetd.policy.deadline import on_demand_to_keep

    base = dict(
        deadline_at=9 * H,
        started_at=0.0,
        total_steps=6 * H * 4,
        done_steps=0.0,
        changeover_s=0.2 * H,
        full_on_spot=False,
        nodes=4,
    )
    # Line pace 2.67 nodes' worth at 1 step/s per node: 2 whole nodes; 1 on spot -> keep 1 of 3
    # (the remaining 0.67 node cycles as UP's one node does).
    assert on_demand_to_keep(DeadlineInputs(**base, steps_per_s=4.0, on_demand_nodes=3, spot_training=1)) == 1
    # A measured scaling loss (3.6 steps/s at 4: 0.9 per node) needs more nodes: 2.96 -> 2 whole.
    assert on_demand_to_keep(DeadlineInputs(**base, steps_per_s=3.6, on_demand_nodes=3, spot_training=0)) == 2
    slow = {**base, "total_steps": 8 * H * 4}  # 3.56 nodes' worth -> 3
    assert on_demand_to_keep(DeadlineInputs(**slow, steps_per_s=4.0, on_demand_nodes=3, spot_training=1)) == 2
    # Enough spot to hold the pace: none kept; no on-demand, or one node: none.
    assert on_demand_to_keep(DeadlineInputs(**base, steps_per_s=4.0, on_demand_nodes=1, spot_training=3)) == 0
    assert on_demand_to_keep(DeadlineInputs(**base, steps_per_s=4.0, on_demand_nodes=0, spot_training=1)) == 0
    one = {**base, "nodes": 1, "total_steps": 6 * H}
    assert on_demand_to_keep(DeadlineInputs(**one, steps_per_s=1.0, on_demand_nodes=1)) == 0


@pytest.mark.parametrize(
    ("nodes", "stall_s", "swap"), [(4, 0.0, True), (4, 5.0, False), (1, 5.0, True), (8, 2.0, True), (8, 3.0, False)]
)
def test_a_safety_net_swap_keeps_slack_for_the_re_forms_it_and_the_losses_after_it_cause(nodes, stall_s, swap) -> None:
    # d = 0.2 h: d + d/4 = 900 s; slack 940 s. The stall budget is 2 (N + 1) membership stalls:
    # 4 nodes at 5 s: 50 s (no swap); 1 node: 20 s (swap); 8 nodes at 2 s: 36 s (swap), at 3 s: 54 s.
    i = DeadlineInputs(
        deadline_at=10 * H,
        started_at=0.0,
        total_steps=6 * H - 940.0,
        done_steps=0.0,
        steps_per_s=1.0,
        changeover_s=0.2 * H,
        full_on_spot=False,
        nodes=nodes,
        membership_stall_s=stall_s,
    )
    call = decide(i, 4 * H)
    assert call.safety_net
    assert call.stall_budget_s == pytest.approx(2 * (nodes + 1) * stall_s)
    assert call.swap_to_spot is swap


@pytest.mark.parametrize(("done_h", "branch"), [(1.8, "behind"), (2.05, "ahead within 2d")])
def test_outside_the_net_on_demand_goes_back_to_spot_make_before_break_once_spot_is_offered(done_h, branch) -> None:
    # 6 h of work due 9 h after the start; at 3 h the line stands at 2 h; d = 0.2 h. Behind it, or
    # ahead by less than 2d, UP keeps its on-demand node (a changeover to spot would stop it for
    # d). fleetd's on-demand node trains while the spot node boots, so the swap costs no time: it
    # is allowed whenever the slack covers losing the spot node again (d + d / 4 + re-forms) and
    # leaves 2d after the swap's own re-forms. Measured (bench/deadline.py, waves7d, one node):
    # cheaper per useful step at 14 of 15 (due, d) cases, where holding on-demand until 2d ahead
    # had missed spot's return.
    i, now = inputs(done_h=done_h, now_h=3.0, d_h=0.2)
    i = DeadlineInputs(**{**{f: getattr(i, f) for f in i.__slots__}, "on_demand_nodes": 1})
    call = decide(i, now)
    assert not call.safety_net and call.spot_allowed and not call.on_demand_not_needed
    assert call.swap_to_spot and "back to spot make-before-break" in call.reason, branch
    # Outside the net (slack 4,000 s >= 2d = 3,600 s) but not 2d after the swap's own join and
    # drain (2 re-forms of 5 min): on-demand stays.
    tight = DeadlineInputs(
        deadline_at=9 * H,
        started_at=0.0,
        total_steps=21_200.0,
        done_steps=3_600.0,
        steps_per_s=1.0,
        changeover_s=0.5 * H,
        full_on_spot=False,
        nodes=1,
        on_demand_nodes=1,
        membership_stall_s=300.0,
    )
    tight_call = decide(tight, 3 * H)
    assert not tight_call.safety_net and tight_call.on_demand_now and not tight_call.swap_to_spot
    # A fleet keeps its own rule outside the net (on_demand_keep; swapping every on-demand node
    # into a pool between reclaim waves cost 4 and 8 nodes up to 9 % more per useful step).
    fleet = DeadlineInputs(
        **{
            **{f: getattr(i, f) for f in i.__slots__},
            "nodes": 4,
            "steps_per_s": 4.0,
            "total_steps": 4 * i.total_steps,
            "done_steps": 4 * i.done_steps,
        }
    )
    assert not decide(fleet, now).safety_net and not decide(fleet, now).swap_to_spot


def test_planner_behind_the_line_moves_its_on_demand_node_back_to_spot_keeping_it_until_then() -> None:
    # One node on on-demand, behind the line (1 h done 3 h into a 6 h job due at 9 h), spot offered
    # again: one spot launch to take its place; the on-demand node is not drained in this pass.
    cfg = deadline_cfg(1, due_h=6, total_steps=6 * 3600, d_s=0.2 * H)
    od = node("od-1", market=Market.ON_DEMAND, price=1.0, step=3600)
    obs = Observation(
        nodes=(od,),
        offers=(offer(A, 0.4), offer(B, 0.4)),
        target_nodes=1,
        last_scaling_at=NOW,
        throughput_by_nodes=MappingProxyType({1: 1.0}),
        job_started_at=NOW - 3 * H,
    )
    result = plan(obs, cfg, NOW)
    assert result.deadline is not None and result.deadline.on_demand_now and result.deadline.swap_to_spot
    (launch,) = result.of_type(Launch)
    assert launch.market is Market.SPOT and launch.purpose is LaunchPurpose.RETURN_TO_SPOT
    assert not [a for a in result.actions if getattr(a, "instance_id", None) == "od-1"], "make-before-break"
    # With spot refused (a fresh capacity error) nothing changes: the on-demand node trains on.
    held = plan(
        Observation(**{**{f: getattr(obs, f) for f in obs.__dataclass_fields__}, "pool_stats": NO_SPOT}), cfg, NOW
    )
    assert held.of_type(Launch) == () and not [a for a in held.actions if getattr(a, "instance_id", None) == "od-1"]
