"""Play a scenario against the running demo: the demo is AWS here.

A notice appears at the node's IMDS and, ``notice_s`` later, the instance is terminated in EC2
whether the fleet was ready or not. A node that vanishes gets no notice: its whole process tree
is frozen at once (its peers' collectives hang, as with a machine that is gone), and the instance
is terminated in EC2 ``VANISH_TERMINATE_AFTER_S`` later. A capacity error makes the cheapest spot
pool answer CreateFleet with InsufficientInstanceCapacity (through the fault proxy, in AWS's own
payload). Steps due at the same moment are applied back to back, so a wave reaches its nodes
within a millisecond; ``notice-all`` notices every live spot node at once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

from agent.supervise.proctree import kill_tree, process_tree
from fleetd.adapters.faults import FaultProxy
from fleetd.adapters.pricing import DEMO_PRICE_BOOK, FilePriceBook
from fleetd.demo import configs
from fleetd.demo.progress import Progress
from fleetd.demo.scenario import Step
from fleetd.policy.model import PoolId
from fleetd.shared.logs import get_logger

log = get_logger(__name__)
# A vanished instance's EC2 state changes soon after the machine stops answering; until then
# only the rendezvous heartbeats and MQTT keep-alives can tell.
VANISH_TERMINATE_AFTER_S = 10.0
# A step aimed at a replacement waits this long for fleetd to have bought one.
REPLACEMENT_WAIT_S = 90.0


def types_by_price() -> list[list[PoolId]]:
    """The demo's instance types, cheapest spot price first, each with its pools."""
    book = FilePriceBook.load(DEMO_PRICE_BOOK)
    cheapest: dict[str, float] = {}
    pools: dict[str, list[PoolId]] = {}
    for pool in book.pools:
        price = book.price_at(pool, time.time())
        if pool.instance_type in configs.DEMO_TYPES and pool.zone in configs.DEMO_ZONES and price and price.spot:
            cheapest[pool.instance_type] = min(price.spot, cheapest.get(pool.instance_type, price.spot))
            pools.setdefault(pool.instance_type, []).append(pool)
    return [pools[t] for t in sorted(cheapest, key=cheapest.__getitem__)]


async def play_scenario(run: Any, ec2: Any, proxy: FaultProxy, events_file: Path) -> None:
    scenario = run.opts.scenario
    if scenario is None or not scenario.steps:
        return
    while run.training_since is None:
        await asyncio.sleep(0.5)
    async with asyncio.TaskGroup() as reclaims:
        for step in sorted(scenario.steps, key=lambda s: s.at_s):
            await asyncio.sleep(max(0.0, run.training_since + step.at_s - time.time()))
            if step.kind == "notice-all":
                targets = _notice_all(run)
            else:
                if step.pick == "replacement":
                    await _wait_for_replacement(run)
                if step.kind == "vanish":
                    await _wait_for_survivors(run, events_file)
                target = await _apply(run, step, proxy)
                targets = [target] if target is not None and step.kind in ("notice", "vanish") else []
            for target in targets:
                after = scenario.notice_s if step.kind != "vanish" else VANISH_TERMINATE_AFTER_S
                reclaims.create_task(_reclaim(run, ec2, target, after))
    run.story_played_at, run.story_fleet = time.time(), run.opts.nodes
    log.info("demo_story_played", steps=len(scenario.steps))


def _noticed(run: Any) -> set[str]:
    return {t for _, kind, t in run.injected if kind == "notice"}


def _replacements(run: Any) -> list[Any]:
    """Live spot nodes bought after training began and not noticed yet, newest first."""
    began = run.training_since_loop if run.training_since_loop is not None else float("inf")
    noticed = _noticed(run)
    return sorted(
        (
            n
            for n in run.launcher.live()
            if n.lifecycle == "spot" and n.started_at > began and n.instance_id not in noticed
        ),
        key=lambda n: n.started_at,
        reverse=True,
    )


async def _wait_for_replacement(run: Any) -> None:
    until = time.time() + REPLACEMENT_WAIT_S
    while not _replacements(run) and time.time() < until:
        await asyncio.sleep(0.2)


async def _wait_for_survivors(run: Any, events_file: Path) -> None:
    """A loss without notice shows the survivors saving the step they completed: the story needs
    a survivor. On a slow box the replacements of earlier notices may not have joined yet, and
    losing the only training node costs every step since the last durable checkpoint (a real
    outcome, but not this story's): wait, bounded, for a world of two."""
    until = time.time() + REPLACEMENT_WAIT_S
    while time.time() < until:
        if _world(run, events_file) >= 2:
            return
        await asyncio.sleep(0.5)
    log.warning("demo_vanish_without_survivor", why=f"no world of two within {REPLACEMENT_WAIT_S:.0f} s")


def _world(run: Any, events_file: Path) -> int:
    """The training world's size: the job's last step report, else (code that reports no step:
    folder mode) the rendezvous round fleetd's last pass saw."""
    steps = [r for r in Progress.load(events_file).records if r["ev"] == "step"]
    if steps:
        return int(steps[-1].get("world", 1))
    from fleetd.demo.view import status_snapshot

    snap = status_snapshot(run.workdir)
    return snap.rendezvous.world_size if snap is not None and snap.rendezvous is not None else 0


def _notice_all(run: Any) -> list[str]:
    """The whole pool goes at once: every live spot node gets its notice in the same instant."""
    noticed = _noticed(run)
    nodes = [n for n in run.launcher.live() if n.lifecycle == "spot" and n.instance_id not in noticed]
    run.injected.append((time.time(), "notice-all", ""))
    for node in nodes:
        node.imds.schedule_notice(action_in_s=run.opts.scenario.notice_s)
        run.injected.append((time.time(), "notice", node.instance_id))
    log.info("demo_injected", kind="notice-all", instance_ids=[n.instance_id for n in nodes])
    return [n.instance_id for n in nodes]


async def _apply(run: Any, step: Step, proxy: FaultProxy) -> str | None:
    launcher = run.launcher
    noticed = _noticed(run)
    if step.kind in ("notice", "rebalance", "vanish"):
        if step.pick == "replacement":
            spot = _replacements(run)
        else:
            spot = sorted(
                (n for n in launcher.live() if n.lifecycle == "spot" and n.instance_id not in noticed),
                key=lambda n: n.started_at,
            )
        if len(spot) <= step.target:
            log.warning("demo_step_skipped", step=step.kind, why="no live spot node to target")
            return None
        node = spot[step.target]
        if step.kind == "notice":
            node.imds.schedule_notice(action_in_s=run.opts.scenario.notice_s)
        elif step.kind == "vanish":
            # Agent, torchrun, warm pool, workers: all stop answering at once. The launcher
            # kills the tree when EC2 terminates the instance (a frozen agent stops nothing).
            node.frozen_tree = process_tree(node.agent.proc.pid)
            kill_tree(node.frozen_tree, signal.SIGSTOP)
        else:
            node.imds.schedule_rebalance()
        run.injected.append((time.time(), step.kind, node.instance_id))
        log.info("demo_injected", kind=step.kind, instance_id=node.instance_id)
        injected: str = node.instance_id
        return injected
    if step.kind == "capacity-error":
        pools = types_by_price()[step.target]
        for pool in pools:
            proxy.fail("CreateFleet", "InsufficientInstanceCapacity", pool=pool, times=None)
        target = pools[0].instance_type
        run.injected.append((time.time(), step.kind, target))
        log.info("demo_injected", kind=step.kind, instance_type=target)
        return target
    if step.kind == "capacity-restored":
        proxy.clear()
        run.injected.append((time.time(), step.kind, ""))
        return None
    raise ValueError(f"unknown scenario step {step.kind!r}")


async def _reclaim(run: Any, ec2: Any, instance_id: str, notice_s: float) -> None:
    """AWS acts when the notice period ends, ready or not."""
    await asyncio.sleep(notice_s)
    node = run.launcher.nodes.get(instance_id)
    if node is not None and node.stopped_at is None:
        await ec2.terminate_instances(InstanceIds=[instance_id])
        log.info("demo_reclaimed", instance_id=instance_id, after_s=notice_s)
