"""Who saves for a hold that protects leaving nodes (agent/trainer/hold_plan.py): a leaver with
replicated state saves nothing when a node stays, and every rank reaches the same plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.trainer import local_ckpt
from agent.trainer.context import TrainerContext
from agent.trainer.hold_plan import SAVE_EVERYWHERE, HoldPlan, agreed_plan, plan_hold, wait_for_local_copy

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


@pytest.mark.parametrize(
    ("case", "mode", "hold", "leaving", "me", "nodes", "want"),
    [
        ("a leaver, two nodes stay", "state_dict", True, (A,), A, 3, HoldPlan(save=False, world_barrier=False)),
        ("a node that stays", "state_dict", True, (A,), B, 3, HoldPlan(save=True, world_barrier=False)),
        ("the whole world leaves", "state_dict", True, (A, B, C), A, 3, SAVE_EVERYWHERE),
        ("names of nodes already gone count", "state_dict", True, (A, B, "10.0.0.9"), A, 3, SAVE_EVERYWHERE),
        ("a wave names a node twice", "state_dict", True, (A, A), A, 3, HoldPlan(False, False)),
        ("sharded state: every shard is needed", "dcp", True, (A,), A, 3, SAVE_EVERYWHERE),
        ("no hold (a periodic or the planner's)", "state_dict", False, (A,), A, 3, SAVE_EVERYWHERE),
        ("a join's hold: nobody leaves", "state_dict", True, (), A, 3, SAVE_EVERYWHERE),
    ],
)
def test_plan(case: str, mode, hold, leaving, me, nodes, want) -> None:  # type: ignore[no-untyped-def]
    assert plan_hold(mode, hold, leaving, me, nodes) == want, case


class World:
    """The all-reduces of one world, over what each rank contributes (ranks call in lockstep)."""

    def __init__(self, size: int) -> None:
        self.size, self.calls = size, []

    def run(self, inputs: list[tuple[tuple[str, ...], TrainerContext]]) -> list[HoldPlan]:
        """Each rank's agreed plan; ``inputs``: the leaving names each rank read, its context."""
        contributions: list[list[int]] = [[] for _ in inputs]
        # First pass: record what each rank contributes to each all-reduce, in order.
        for i, (leaving, ctx) in enumerate(inputs):
            agreed_plan("state_dict", True, leaving, ctx, lambda v, op, i=i: contributions[i].append(v) or v)
        ops = ["SUM", "MAX", "MIN"]
        reduced = [{"SUM": sum, "MAX": max, "MIN": min}[op](c[k] for c in contributions) for k, op in enumerate(ops)]
        out = []
        for leaving, ctx in inputs:
            it = iter(reduced)
            out.append(agreed_plan("state_dict", True, leaving, ctx, lambda v, op, it=it: next(it)))
        return out


def ctx(rank: int, local: int, addr: str) -> TrainerContext:
    return TrainerContext(rank=rank, local_rank=local, node_addr=addr, world_size=8)


def test_nodes_of_unequal_sizes_are_counted_by_the_world() -> None:
    """A 4-rank node and two 2-rank nodes, the two small ones leaving: every rank agrees that one
    node stays (counted from the world, not from its own node's size)."""
    ranks = (
        [ctx(r, r, A) for r in range(4)] + [ctx(4 + r, r, B) for r in range(2)] + [ctx(6 + r, r, C) for r in range(2)]
    )
    plans = World(8).run([((B, C), c) for c in ranks])
    assert {p.world_barrier for p in plans} == {False}
    assert [p.save for p in plans] == [True] * 4 + [False] * 4


def test_ranks_that_read_the_requests_differently_all_save_with_the_barrier() -> None:
    """A rank that read a request late (or not at all) would skip a barrier the others wait in."""
    ranks = [ctx(r, 0, addr) for r, addr in enumerate((A, B, C))]
    plans = World(3).run([((A,), ranks[0]), ((A,), ranks[1]), ((), ranks[2])])
    assert plans == [SAVE_EVERYWHERE] * 3


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
