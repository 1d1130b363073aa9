"""Who saves for a hold that protects leaving nodes (agent/trainer/hold_plan.py): a leaver with
replicated state saves nothing when a node stays, and every rank reaches the same plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.trainer import local_ckpt
from agent.trainer.hold_plan import SAVE_EVERYWHERE, HoldPlan, plan_hold, wait_for_local_copy

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


@pytest.mark.parametrize(
    ("case", "mode", "hold", "leaving", "me", "world", "local", "want"),
    [
        ("a leaver, two nodes stay", "state_dict", True, (A,), A, 3, 1, HoldPlan(save=False, world_barrier=False)),
        ("a node that stays", "state_dict", True, (A,), B, 3, 1, HoldPlan(save=True, world_barrier=False)),
        ("two GPUs a node, one of two leaves", "state_dict", True, (A,), A, 4, 2, HoldPlan(False, False)),
        ("the whole world leaves", "state_dict", True, (A, B, C), A, 3, 1, SAVE_EVERYWHERE),
        ("names of nodes already gone count", "state_dict", True, (A, B, "10.0.0.9"), A, 3, 1, SAVE_EVERYWHERE),
        ("a wave names a node twice", "state_dict", True, (A, A), A, 3, 1, HoldPlan(False, False)),
        ("sharded state: every shard is needed", "dcp", True, (A,), A, 3, 1, SAVE_EVERYWHERE),
        ("no hold (a periodic or the planner's)", "state_dict", False, (A,), A, 3, 1, SAVE_EVERYWHERE),
        ("a join's hold: nobody leaves", "state_dict", True, (), A, 3, 1, SAVE_EVERYWHERE),
        ("nodes of unequal sizes", "state_dict", True, (A,), A, 5, 2, SAVE_EVERYWHERE),
    ],
)
def test_plan(case: str, mode, hold, leaving, me, world, local, want) -> None:  # type: ignore[no-untyped-def]
    assert plan_hold(mode, hold, leaving, me, world, local) == want, case


def test_every_rank_of_a_world_reaches_a_matching_plan() -> None:
    """The collectives stay matched: no rank waits in a barrier another rank skips."""
    nodes = (A, B, C)
    plans = [plan_hold("state_dict", True, (B,), nodes[r // 2], 6, 2) for r in range(6)]
    assert len({p.world_barrier for p in plans}) == 1
    assert [p.save for p in plans] == [True, True, False, False, True, True]


def test_a_rank_waits_for_its_nodes_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, polls = local_ckpt.is_complete, []

    def is_complete(directory: Path, mode: local_ckpt.Mode) -> bool:
        polls.append(real(directory, mode))
        if len(polls) == 3:  # local rank 0's copy lands while this rank waits
            local_ckpt.save_plain(tmp_path, 7, {"w": 1})
        return polls[-1]

    monkeypatch.setattr(local_ckpt, "is_complete", is_complete)
    assert wait_for_local_copy(tmp_path, 7, timeout_s=60, poll_s=0.001)
    assert polls[:3] == [False, False, False] and polls[-1], polls  # it waited, then saw the copy
    assert not wait_for_local_copy(tmp_path, 8, timeout_s=0.05, poll_s=0.001)
