"""With replicated state a noticed node may leave while its copy of step N uploads, because a
survivor holds step N too. When every node that saved step N is noticed (a whole-fleet notice)
there is no survivor, and fleetd terminates a node as soon as it has left: the node must keep its
process alive until its copy is durable, or the notice's checkpoint dies with the fleet.

The store link and torchrun are in-memory doubles: what is tested is the flow's decision, over the
same key models the real store carries (the end-to-end wave runs in tests/test_demo.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.supervise.emergency import EmergencyFlow
from agent.supervise.torchrun import TorchrunExit
from agent.trainer import local_ckpt
from fleetd.protocol import rendezvous_keys as keys

STEP = 881
NODES = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


class MemoryLink:
    """The part of agent.trainer.store_link.StoreLink the emergency flow uses."""

    def __init__(self, noticed: set[str]) -> None:
        self.noticed_addrs = set(noticed)
        self.events: list[tuple[str, str]] = []

    def member(self, addr: str) -> keys.Member:
        return keys.Member(world_size=len(NODES))

    def mark_noticed(self, addr: str, value: keys.Noticed) -> None:
        self.noticed_addrs.add(addr)

    def noticed(self, addr: str) -> keys.Noticed | None:
        return keys.Noticed(reason="spot notice") if addr in self.noticed_addrs else None

    def request_checkpoint(self, reason: str, *, hold: bool = False, leaving: tuple = (), by: str = "") -> int:
        return 1

    def acks(self, seq: int) -> list[keys.CheckpointAck]:
        return [
            keys.CheckpointAck(seq=seq, step=STEP, rank=r, world_size=len(NODES), node_addr=a)
            for r, a in enumerate(NODES)
        ]

    def mark_drain_ready(self, addr: str, value: keys.DrainReady) -> None:
        self.events.append(("drain_ready", f"durable={value.durable}"))

    def leave_requested(self, addr: str) -> keys.Leave | None:
        return None

    def mark_left(self, addr: str, value: keys.Left) -> None:
        self.events.append(("left", ""))


class StubTorchrun:
    running = True

    def kill(self) -> None:
        self.running = False

    async def wait(self) -> TorchrunExit:
        return TorchrunExit(exit_code=-9, reason="stopped")


class SlowUploader:
    """An upload that takes a while; it records in the link's event list when it is durable."""

    def __init__(self, link: MemoryLink) -> None:
        self.link = link

    async def upload(self, step: int, directory: Path, *, deadline: object) -> bool:
        await asyncio.sleep(0.3)
        self.link.events.append(("durable", str(step)))
        return True


def _flow(tmp_path: Path, link: MemoryLink) -> EmergencyFlow:
    step_dir = local_ckpt.step_dir(tmp_path, STEP)
    step_dir.mkdir(parents=True)
    (step_dir / local_ckpt.PLAIN_FILE).write_bytes(b"weights")
    (step_dir / local_ckpt.MARKER).write_text("{}")
    flow = EmergencyFlow(
        link,
        NODES[0],
        StubTorchrun(),
        tmp_path,
        uploader=SlowUploader(link),  # type: ignore[arg-type]
        poll_s=0.01,
        leave_wait_s=0.05,
    )
    return flow


@pytest.mark.asyncio
async def test_with_a_survivor_the_node_leaves_while_its_copy_uploads(tmp_path: Path) -> None:
    link = MemoryLink(noticed={NODES[1]})  # NODES[2] is not noticed: it holds step N and stays
    outcome = await _flow(tmp_path, link).run(reason="spot notice")
    order = [kind for kind, _ in link.events]
    assert order.index("left") < order.index("durable"), link.events
    assert outcome.step == STEP and outcome.durable


@pytest.mark.asyncio
async def test_when_every_holder_is_noticed_the_node_leaves_only_once_its_copy_is_durable(tmp_path: Path) -> None:
    link = MemoryLink(noticed=set(NODES[1:]))  # the whole fleet is noticed
    outcome = await _flow(tmp_path, link).run(reason="spot notice")
    assert [kind for kind, _ in link.events] == ["durable", "drain_ready", "left"], link.events
    assert link.events[1] == ("drain_ready", "durable=True")
    assert outcome.step == STEP and outcome.durable


class HeldOnlyLink(MemoryLink):
    """This node's ranks stopped at the hold and saved nothing (agent/trainer/hold_plan.py); the
    nodes that stay have not acknowledged yet: they are still writing their copies."""

    def acks(self, seq: int) -> list[keys.CheckpointAck]:
        return [
            keys.CheckpointAck(seq=seq, step=STEP, rank=0, world_size=len(NODES), node_addr=NODES[0], held_only=True)
        ]


@pytest.mark.asyncio
async def test_a_node_that_held_only_leaves_without_waiting_for_the_staying_nodes_save(tmp_path: Path) -> None:
    link = HeldOnlyLink(noticed=set())
    flow = _flow(tmp_path, link)
    assert await asyncio.wait_for(flow._wait_saved(1, until=time.monotonic() + 3600), timeout=60) == (STEP, True)
    outcome = await flow.run(reason="spot notice")
    # No upload: its copy (an older one on its disk here) is not the step the job carries on from.
    assert [kind for kind, _ in link.events] == ["drain_ready", "left"], link.events
    assert link.events[0] == ("drain_ready", "durable=False")
    assert outcome.step == STEP and not outcome.durable and "left at the hold" in outcome.detail


@pytest.mark.asyncio
async def test_a_node_with_several_ranks_goes_only_once_every_one_stopped(tmp_path: Path) -> None:
    """Its tree is killed right after: a rank still short of the hold would never ack, and the
    later leavers of a wave would wait for it."""
    link = HeldOnlyLink(noticed=set())
    two = [
        keys.CheckpointAck(
            seq=1, step=STEP, rank=r, world_size=4, node_addr=NODES[0], held_only=True, local_world_size=2
        )
        for r in (0, 1)
    ]
    link.acks = lambda seq: two[:1]  # type: ignore[method-assign]
    flow = _flow(tmp_path, link)
    assert await flow._wait_saved(1, until=time.monotonic() + 0.2) == (None, False)  # kept waiting
    link.acks = lambda seq: two  # type: ignore[method-assign]
    assert await flow._wait_saved(1, until=time.monotonic() + 3600) == (STEP, True)


def test_a_held_only_ack_does_not_count_as_a_survivors_copy(tmp_path: Path) -> None:
    link = MemoryLink(noticed={NODES[1]})
    flow = _flow(tmp_path, link)
    assert flow._a_survivor_holds(1, STEP)  # NODES[2] saved it and stays
    plain = MemoryLink.acks(link, 1)
    link.acks = lambda seq: [  # type: ignore[method-assign]
        a.model_copy(update={"held_only": a.node_addr == NODES[2]}) for a in plain
    ]
    assert not flow._a_survivor_holds(1, STEP)  # NODES[2] stopped without saving: nobody holds it


class WaveLink(MemoryLink):
    """A later notice of a wave: NODES[2] already left; its ranks answered the earlier request
    (seq 1) but can never answer this node's (seq 2)."""

    def __init__(self, left: set[str]) -> None:
        super().__init__(noticed=set(NODES))
        self.left = left

    def request_checkpoint(self, reason: str, *, hold: bool = False, leaving: tuple = (), by: str = "") -> int:
        return 2

    def acks(self, seq: int) -> list[keys.CheckpointAck]:
        everyone = super().acks(seq)
        return everyone if seq == 1 else [a for a in everyone if a.node_addr not in self.left]

    def has_left(self, addr: str) -> bool:
        return addr in self.left


@pytest.mark.asyncio
async def test_a_later_notice_does_not_wait_for_the_ranks_of_a_node_already_gone(tmp_path: Path) -> None:
    link = WaveLink(left={NODES[2]})
    flow = _flow(tmp_path, link)
    # Returns on the acknowledgements that can come (an hour's bound: waiting out the bound is
    # the old behaviour, which hangs this test into its timeout instead).
    step = await asyncio.wait_for(flow._wait_saved(2, until=time.monotonic() + 3600), timeout=60)
    assert step == (STEP, False)
    outcome = await flow.run(reason="spot notice")
    assert outcome.step == STEP and outcome.durable
    assert [kind for kind, _ in link.events] == ["durable", "drain_ready", "left"], link.events


def test_a_silent_rank_on_a_node_still_here_is_waited_for(tmp_path: Path) -> None:
    link = WaveLink(left=set())  # NODES[2] has not answered seq 2 and has not left: wait for it
    link.acks = lambda seq: [
        a
        for a in MemoryLink.acks(link, seq)  # type: ignore[method-assign]
        if seq == 1 or a.node_addr != NODES[2]
    ]
    flow = _flow(tmp_path, link)
    assert not flow._every_remaining_rank_acked(2, link.acks(2))
    link.left.add(NODES[2])
    assert flow._every_remaining_rank_acked(2, link.acks(2))
    # A rank whose owner the earlier requests do not tell (another world): keep waiting.
    assert not flow._every_remaining_rank_acked(1, link.acks(1)[:2])


class ReformingLink(MemoryLink):
    """The world is re-forming when the notice comes: no rank runs, so nobody acknowledges."""

    def acks(self, seq: int) -> list[keys.CheckpointAck]:
        return []


class SalvagingTorchrun(StubTorchrun):
    """SIGTERM (``stop``) lets a worker save the step it completed; SIGKILL (``kill``) does not."""

    def __init__(self, ckpt_dir: Path, step: int) -> None:
        self.ckpt_dir, self.step, self.signals = ckpt_dir, step, []

    def kill(self) -> None:
        self.signals.append("SIGKILL")
        super().kill()

    async def stop(self, timeout_s: float = 10.0) -> TorchrunExit:
        self.signals.append("SIGTERM")
        step_dir = local_ckpt.step_dir(self.ckpt_dir, self.step)
        step_dir.mkdir(parents=True)
        (step_dir / local_ckpt.PLAIN_FILE).write_bytes(b"salvaged")
        (step_dir / local_ckpt.MARKER).write_text("{}")
        self.running = False
        return TorchrunExit(exit_code=1, reason="stopped")


@pytest.mark.asyncio
async def test_with_no_step_acknowledged_the_node_salvages_and_uploads_its_newest_local_step(tmp_path: Path) -> None:
    """A loaded storm run: the wave came while the world re-formed, no request was acknowledged,
    the nodes left with nothing uploaded, and the world that formed after trained 7 steps that
    died with it. The node now stops its tree with SIGTERM (the workers save what they completed)
    and makes its newest complete local step durable before it says it has left."""
    from datetime import UTC, datetime, timedelta

    link = ReformingLink(noticed=set(NODES[1:]))
    flow = _flow(tmp_path, link)  # holds step STEP locally
    flow.torchrun = SalvagingTorchrun(tmp_path, STEP + 7)  # type: ignore[assignment]
    outcome = await flow.run(deadline=datetime.now(UTC) + timedelta(seconds=8), reason="spot notice")
    assert flow.torchrun.signals == ["SIGTERM"]  # type: ignore[attr-defined]
    assert outcome.step == STEP + 7 and outcome.durable, outcome
    assert [kind for kind, _ in link.events] == ["drain_ready", "durable", "left"], link.events
    assert link.events[1] == ("durable", str(STEP + 7))
    assert "newest local step" in outcome.detail
