"""Interruption scenarios for the demo: what AWS does to the fleet, and when.

A scenario is a list of timed steps relative to the moment the first node trains. The demo plays
AWS: a notice appears at the node's (fake) IMDS, and after the notice period the instance is
terminated in EC2 whether or not the fleet was ready — exactly the contract of a real spot notice.
AWS's notice is best effort: a ``vanish`` step loses a node with none (its processes freeze, as a
machine that is gone answers nothing, and the instance is terminated in EC2 shortly after).
Times are compressed (a 120 s notice becomes ``notice_s``) so the demo fits in minutes.

Steps at the same ``at_s`` are applied back to back (within a millisecond): that is how a wave
that takes several nodes at once is played (``storm``, and every removal of a ``--trace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

StepKind = Literal["notice", "notice-all", "rebalance", "capacity-error", "capacity-restored", "vanish"]
# Which node a node step takes: the N-th oldest live spot node ("oldest"), or the newest
# replacement while it is still restoring ("replacement": the step waits for one to appear).
Pick = Literal["oldest", "replacement"]


@dataclass(frozen=True)
class Step:
    at_s: float
    kind: StepKind
    # Which node: the N-th oldest live spot node (0 = oldest). For capacity steps: the N-th
    # cheapest instance type of the price book (every zone of it runs dry at once).
    target: int = 0
    pick: Pick = "oldest"


@dataclass(frozen=True)
class FleetShape:
    """How a scenario sizes the fleet (None: the demo's defaults, ``--nodes`` fixed)."""

    min_nodes: int
    max_nodes: int
    initial_nodes: int
    cooldown_s: float
    # The toy trainer's scaling curve (agent/examples/toy_job/train_toy.py): one step's work takes
    # work_s / min(world, saturate_at) seconds, so the job's steps/s grows with each node up to
    # saturate_at nodes and not beyond (a job whose input pipeline or all-reduce caps it).
    work_s: float
    saturate_at: int

    def trainer_env(self) -> dict[str, str]:
        return {"FLEETD_TOY_WORK_S": str(self.work_s), "FLEETD_TOY_SATURATE_AT": str(self.saturate_at)}


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    notice_s: float = 20.0  # compressed two-minute warning
    description: str = ""
    fleet: FleetShape | None = None
    nodes: int | None = None  # the fleet size the story is written for (--nodes overrides)
    duration_s: float | None = None  # training time the story needs (--duration overrides)
    # The job's total steps (--steps overrides): the demo ends when the job finishes, with
    # duration_s only as a cap. None: the job never finishes; the demo ends after duration_s.
    job_steps: int | None = None
    # Pace the toy's steps (seconds of work per step, shared by up to pace_nodes nodes): a job
    # that must finish *after* the story has played cannot be faster on a quick machine.
    pace_work_s: float = 0.0
    pace_nodes: int = 1

    def trainer_env(self) -> dict[str, str]:
        if self.fleet is not None:
            return self.fleet.trainer_env()
        if self.pace_work_s > 0:
            return {"FLEETD_TOY_WORK_S": str(self.pace_work_s), "FLEETD_TOY_SATURATE_AT": str(self.pace_nodes)}
        return {}


NAMED: dict[str, Scenario] = {
    "default": Scenario(
        "default",
        (
            Step(30, "notice", 0),
            Step(58, "capacity-error", 0),
            Step(60, "rebalance", 0),
            Step(80, "notice", 0),
            Step(110, "vanish", 0),
            Step(130, "capacity-restored", 0),
        ),
        description="two notices (the second after a rebalance recommendation); the cheapest "
        "instance type runs out of capacity just as fleetd pre-buys a replacement; then a node "
        "is lost with no notice at all; in a job of 2,400 steps that runs to the end: fleetd sees "
        "it succeed and releases every node",
        # At most 15 steps/s at 3 nodes: the job outlasts the story (the last event is at 130 s).
        job_steps=2400,
        pace_work_s=0.2,
        pace_nodes=3,
        duration_s=480.0,  # a cap: the demo ends when the job does
    ),
    "short": Scenario(
        "short",
        (
            Step(10, "notice", 0),
            Step(24, "capacity-error", 0),
            Step(25, "rebalance", 0),
            Step(35, "notice", 0),
            Step(48, "vanish", 0),
        ),
        notice_s=12.0,
        description="the default story in half the time (CI), in a job of 1,200 steps that runs to "
        "the end: fleetd sees it succeed and releases every node",
        # At most 15 steps/s at 3 nodes: the job outlasts the story (the last event is at 48 s).
        job_steps=1200,
        pace_work_s=0.2,
        pace_nodes=3,
        duration_s=400.0,  # a cap: the demo ends when the job does
    ),
    "storm": Scenario(
        "storm",
        (
            # Two of four nodes noticed in the same second (the same millisecond, in fact).
            Step(20, "notice", 0),
            Step(20, "notice", 0),
            # One of their replacements is noticed while it restores (it has not trained yet).
            Step(21, "notice", 0, pick="replacement"),
            # Then the whole pool goes: every live node, well inside three minutes of the first.
            Step(75, "notice-all"),
        ),
        description="a correlated wave: two of four nodes noticed in the same second, a "
        "replacement noticed while it restores, then every node within three minutes; the "
        "checkpoint taken inside the last notice is the one the replacements resume from",
        nodes=4,
        # Less compressed than the others: four nodes checkpoint, upload and leave inside one
        # notice on a box also running their replacements (a real notice is 120 s; at 20 s a
        # loaded 2-core CI box ran out of notice). Nodes leave when done, so it costs no time.
        notice_s=45.0,
        duration_s=240.0,  # the replacements of the whole fleet boot, restore and train
    ),
    "calm": Scenario("calm", (), description="no interruptions: baseline throughput and cost"),
    "scaling": Scenario(
        "scaling",
        (),
        description="the fleet starts at one node and scales on measured throughput per dollar: "
        "the toy job speeds up with a second node and not with a third, so fleetd grows to 2, "
        "explores 3, finds the third node adds nothing and shrinks back to 2",
        fleet=FleetShape(min_nodes=1, max_nodes=4, initial_nodes=1, cooldown_s=20.0, work_s=0.6, saturate_at=2),
    ),
}


def from_trace(path: Path, duration_s: float, max_notices: int = 8) -> Scenario:
    """Turn a spot trace's node removals into notices, one notice per removal.

    Removals at the same trace instant stay at the same instant (a wave is played as a wave).
    A removal of a node the trace added after its start is a replacement's: it is played on the
    demo's newest replacement. Trace times are played as they are when the removals fit in the
    middle of the run, else compressed in proportion; at most ``max_notices`` removals (the demo
    fleet is a few nodes, a 32-node trace's wave cannot all apply).
    """
    from fleetd.sim.traces import ADD, REMOVE, load_trace

    trace = load_trace(path)
    added_later = {ev.node for ev in trace.events if ev.kind == ADD and ev.t > 0}
    removals = sorted((ev for ev in trace.events if ev.kind == REMOVE), key=lambda ev: ev.t)[:max_notices]
    if not removals:
        return Scenario(f"trace:{path.name}", (), description=f"{path} has no removals")
    first = removals[0].t
    span = removals[-1].t - first
    start, usable = 0.15 * duration_s, 0.55 * duration_s
    scale = 1.0 if span <= usable else usable / span
    steps = tuple(
        Step(start + scale * (ev.t - first), "notice", 0, pick="replacement" if ev.node in added_later else "oldest")
        for ev in removals
    )
    instants = len({ev.t for ev in removals})
    return Scenario(
        f"trace:{path.name}",
        steps,
        description=f"{len(steps)} removals at {instants} instants of {path}, time x{scale:.2f}",
    )


def resolve(name: str | None, trace: Path | None, duration_s: float) -> Scenario:
    if trace is not None:
        return from_trace(trace, duration_s)
    key = name or "default"
    if key not in NAMED:
        raise ValueError(f"unknown scenario {key!r}; choose one of {', '.join(sorted(NAMED))}")
    return NAMED[key]
