"""The job lifecycle fold (fleetd/policy/job_state.py): every transition, and how a failure of
the user's code is told from the cloud's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetd.config import FleetdConfig
from fleetd.policy.job_state import (
    ExitClass,
    JobNode,
    JobObservation,
    JobRecord,
    JobSettings,
    JobState,
    NodeExit,
    advance,
    classify_exit,
    desired_job,
)
from fleetd.policy.model import Launch, Market, Node, NodePhase, PoolId, Terminate
from fleetd.policy.observation import DesiredJob, Observation
from fleetd.policy.planner import plan

S = JobSettings(max_restarts=2, settle_s=10.0, explained_window_s=60.0, release_after_s=30.0)


def node(iid: str = "i-1", *, billed: bool = True, training: bool = True, **kw: object) -> JobNode:
    return JobNode(iid, billed=billed, training=training, **kw)  # type: ignore[arg-type]


def obs(now: float, *nodes: JobNode, exits: tuple[NodeExit, ...] = (), **kw: object) -> JobObservation:
    return JobObservation(now=now, nodes=nodes, exits=exits, **kw)  # type: ignore[arg-type]


def test_pending_starting_running_recovering() -> None:
    rec = JobRecord()
    d = advance(rec, obs(0.0), S)
    assert d.record.state is JobState.PENDING and not d.changed
    d = advance(d.record, obs(1.0, node(training=False)), S)
    assert d.record.state is JobState.STARTING and d.changed and d.record.since == 1.0
    d = advance(d.record, obs(2.0, node(), best_step=5), S)
    assert d.record.state is JobState.RUNNING
    d = advance(d.record, obs(3.0, node(training=False), best_step=5), S)
    assert d.record.state is JobState.RECOVERING
    d = advance(d.record, obs(4.0, node(), best_step=6), S)
    assert d.record.state is JobState.RUNNING


def test_a_folder_mode_job_runs_without_reporting_steps() -> None:
    """Folder mode's code reports no step: a trainer running is RUNNING (the job would otherwise
    read STARTING for its whole life), and a trainer gone is RECOVERING."""
    folder = replace(S, reports_steps=False)
    d = advance(JobRecord(), obs(1.0, node(training=False)), folder)
    assert d.record.state is JobState.STARTING
    d = advance(d.record, obs(2.0, node()), folder)
    assert d.record.state is JobState.RUNNING and d.changed
    d = advance(d.record, obs(3.0, node(training=False)), folder)
    assert d.record.state is JobState.RECOVERING
    # With steps expected, a running trainer with none reported yet is still starting.
    assert advance(JobRecord(), obs(2.0, node()), S).record.state is JobState.STARTING


def test_finished_exit_succeeds_once_no_trainer_runs() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    done = NodeExit("i-1", 10.0, "finished", 0)
    # The other node still trains: wait up to settle_s for it (a rank may still fail).
    d = advance(rec, obs(10.5, node("i-1", training=False), node("i-2"), exits=(done,), best_step=99), S)
    assert d.record.state is JobState.RUNNING and d.record.success_at == 10.0
    d = advance(d.record, obs(11.0, node("i-1", training=False), node("i-2", training=False), best_step=100), S)
    assert d.record.state is JobState.SUCCEEDED and d.record.final_step == 100 and d.record.ended_at == 11.0
    # Terminal: nothing moves it again.
    assert advance(d.record, obs(12.0, node(), best_step=200), S).record == d.record


def test_finished_exit_succeeds_after_settle_even_if_a_status_lags() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    done = NodeExit("i-1", 10.0, "finished", 0)
    d = advance(rec, obs(15.0, node("i-2"), exits=(done,), best_step=9), S)
    assert d.record.state is JobState.RUNNING
    d = advance(d.record, obs(20.0, node("i-2"), exits=(done,)), S)
    assert d.record.state is JobState.SUCCEEDED


def test_total_steps_reached_succeeds() -> None:
    d = advance(JobRecord(state=JobState.RUNNING), obs(5.0, node(), best_step=500, total_steps=500), S)
    assert d.record.state is JobState.SUCCEEDED and "total_steps" in d.record.reason


def test_cancel_wins_and_asks_for_a_coordinated_stop() -> None:
    d = advance(JobRecord(state=JobState.RUNNING), obs(5.0, node(), cancel_requested="operator"), S)
    assert d.record.state is JobState.CANCELLED and "operator" in d.record.reason
    assert desired_job(d.record, None, 5.0, S) is DesiredJob.STOP


def test_user_failures_restart_up_to_the_limit_then_fail() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    exits: tuple[NodeExit, ...] = ()
    for n, at in enumerate((100.0, 200.0), start=1):
        exits += (NodeExit("i-1", at, "failed", 1), NodeExit("i-2", at + 1, "failed", 1))
        d = advance(rec, obs(at + 2, node("i-1", training=False), node("i-2", training=False), exits=exits), S)
        rec = d.record
        # Both ranks crashing together is one failure; both trainers are restarted.
        assert rec.restarts == n and rec.state is JobState.RECOVERING
        assert set(d.restart) == {"i-1", "i-2"}
    exits += (NodeExit("i-1", 300.0, "failed", 1),)
    d = advance(rec, obs(301.0, node("i-1", training=False), exits=exits, best_step=40, durable_step=30), S)
    assert d.record.state is JobState.FAILED and "exited with 1" in d.record.reason and d.restart == ()
    assert desired_job(d.record, 30, 301.0, S) is DesiredJob.END


def test_zero_restarts_fails_on_the_first_user_failure() -> None:
    s0 = replace(S, max_restarts=0)
    d = advance(JobRecord(state=JobState.RUNNING), obs(5.0, node(), exits=(NodeExit("i-1", 4.0, "failed", 2),)), s0)
    assert d.record.state is JobState.FAILED


@pytest.mark.parametrize(
    ("ex", "nodes", "extra", "want"),
    [
        (NodeExit("i-1", 50.0, "finished", 0), (), {}, ExitClass.SUCCESS),
        (NodeExit("i-1", 50.0, "stopped", -15), (), {}, ExitClass.INFRASTRUCTURE),
        (NodeExit("i-1", 50.0, "store-lost", 1), (), {}, ExitClass.INFRASTRUCTURE),
        # torchrun's own rendezvous failed (a rank 0 that left as its round closed), long after any notice.
        (
            NodeExit("i-1", 500.0, "rendezvous-failed", 75),
            (node("i-1"), node("i-2", lost_at=30.0)),
            {},
            ExitClass.INFRASTRUCTURE,
        ),
        # The node itself was noticed, drained or lost.
        (NodeExit("i-1", 50.0, "failed", 1), (node("i-1", noticed_at=45.0),), {}, ExitClass.INFRASTRUCTURE),
        (NodeExit("i-1", 50.0, "failed", 1), (node("i-1", leaving=True),), {}, ExitClass.INFRASTRUCTURE),
        # A peer was lost 20 s before: the collective broke under this rank.
        (NodeExit("i-1", 50.0, "failed", 1), (node("i-1"), node("i-2", lost_at=30.0)), {}, ExitClass.INFRASTRUCTURE),
        # The store restarted just before.
        (NodeExit("i-1", 50.0, "failed", 1), (node("i-1"),), {"store_restarted_at": 40.0}, ExitClass.INFRASTRUCTURE),
        # A peer lost long ago explains nothing.
        (NodeExit("i-1", 500.0, "failed", 1), (node("i-1"), node("i-2", lost_at=30.0)), {}, ExitClass.USER_FAILURE),
        # The OOM killer (SIGKILL) with no notice: the job asked for more memory than it has.
        (NodeExit("i-1", 50.0, "failed", -9), (node("i-1"),), {}, ExitClass.USER_FAILURE),
        (NodeExit("i-1", 50.0, "lost", 137), (node("i-1"),), {}, ExitClass.USER_FAILURE),
        (NodeExit("i-1", 50.0, "finished", 3), (node("i-1"),), {}, ExitClass.USER_FAILURE),
    ],
)
def test_classify_exit(ex: NodeExit, nodes: tuple[JobNode, ...], extra: dict[str, float], want: ExitClass) -> None:
    assert classify_exit(ex, obs(ex.at + 1, *nodes, **extra), S) is want


def test_infrastructure_exits_never_fail_the_job() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    exits = tuple(NodeExit("i-1", 100.0 * k, "store-lost", 1) for k in range(1, 20))
    d = advance(rec, obs(2000.0, node("i-1", training=False), exits=exits), S)
    assert d.record.state is JobState.RECOVERING and d.record.restarts == 0 and d.restart == ()
    # A failed exit right after a peer was lost: restarted, not counted.
    lost = (NodeExit("i-1", 2100.0, "failed", 1),)
    d = advance(d.record, obs(2101.0, node("i-1", training=False), node("i-2", lost_at=2090.0), exits=lost), S)
    assert d.record.restarts == 0 and d.restart == ("i-1",) and d.record.state is JobState.RECOVERING


def test_a_rank_failing_right_after_another_finished_is_a_failure() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    exits = (NodeExit("i-1", 10.0, "finished", 0), NodeExit("i-2", 12.0, "failed", 1))
    d = advance(rec, obs(13.0, node("i-1", training=False), node("i-2", training=False), exits=exits), S)
    assert d.record.state is JobState.RECOVERING and d.record.restarts == 1 and d.record.success_at is None


def test_succeeded_releases_nodes_once_the_final_checkpoint_is_durable_or_after_a_bound() -> None:
    rec = JobRecord(state=JobState.SUCCEEDED, ended_at=100.0, final_step=500)
    assert desired_job(rec, 480, 110.0, S) is DesiredJob.RUN
    assert desired_job(rec, 500, 110.0, S) is DesiredJob.END
    assert desired_job(rec, 480, 130.0, S) is DesiredJob.END
    assert desired_job(JobRecord(state=JobState.RUNNING), 500, 130.0, S) is DesiredJob.RUN


def test_planner_terminates_every_node_of_a_job_that_is_over() -> None:
    cfg = FleetdConfig()
    pool = PoolId("g5.xlarge", "us-east-1a")
    nodes = tuple(
        Node(f"i-{k}", pool, Market.SPOT, 0.5, launched_at=0.0, phase=NodePhase.RUNNING, last_seen_at=99.0)
        for k in range(3)
    )
    p = plan(Observation(nodes=nodes, desired_job=DesiredJob.END), cfg, now=100.0)
    assert p.target_nodes == 0
    assert sorted(a.instance_id for a in p.actions if isinstance(a, Terminate)) == ["i-0", "i-1", "i-2"]
    assert not [a for a in p.actions if isinstance(a, Launch)]


def test_a_node_failing_again_right_after_its_restart_is_a_new_failure() -> None:
    rec = JobRecord(state=JobState.RUNNING)
    exits = (NodeExit("i-1", 100.0, "failed", 1), NodeExit("i-1", 104.0, "failed", 1))
    d = advance(rec, obs(105.0, node("i-1", training=False), exits=exits), S)
    assert d.record.restarts == 2 and d.record.state is JobState.RECOVERING
    exits += (NodeExit("i-1", 108.0, "failed", 1),)
    assert advance(d.record, obs(109.0, node("i-1", training=False), exits=exits), S).record.state is JobState.FAILED


def test_a_node_on_its_way_out_is_never_restarted() -> None:
    """A whole-fleet notice: every node's tree exits (code 1) inside the drain. Restarting them
    would cut the wave's checkpoint short (a storm demo lost 47 steps that way)."""
    rec = JobRecord(state=JobState.RUNNING)
    exits = (
        NodeExit("i-1", 100.0, "failed", 1),
        NodeExit("i-2", 100.5, "failed", 1),
        NodeExit("i-3", 101.0, "lost", -9),
    )
    nodes = (
        node("i-1", training=False, noticed_at=90.0),
        node("i-2", training=False, leaving=True),
        node("i-3", training=False, lost_at=99.0),
    )
    d = advance(rec, obs(102.0, *nodes, exits=exits), S)
    assert d.restart == () and d.record.restarts == 0


def test_a_failed_setup_is_the_jobs_failure_and_its_cause_says_setup() -> None:
    reason = "setup-failed: setup `pip install -r requirements.txt` exited 1: No matching distribution for foo"
    s0 = JobSettings(max_restarts=0)
    d = advance(JobRecord(state=JobState.RUNNING), obs(5.0, node(), exits=(NodeExit("i-1", 4.0, reason, 1),)), s0)
    assert d.record.state is JobState.FAILED
    assert (
        "the job's setup failed on i-1: setup `pip install" in d.record.reason
        and "No matching distribution" in d.record.reason
    )
