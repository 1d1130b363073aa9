"""A job's daemon as a member of a team (``[team] member = true``): before every pass it reads its
allotment (``<fleet.state_dir>/allotment.json``, written by ``fleetd team``) and plans inside it
(fleetd/policy/team_share.py: fleet size, USD/h and total at most the share's).

A pause is the job's coordinated stop (checkpoint, upload, stop every node: the planner's StopJob),
marked in the state store as the team's, so that a resume can undo that stop and only that one: a
stop the budget or an operator asked for is asked for again on the next pass by whoever asked. A
resume waits until the stopped nodes are gone, reopens the job's rendezvous (closed for good at
the stop) and cancels a stop sequence still under way; the job starts again from its durable
checkpoint on fresh nodes, as after any stop. A job held with no node running (paused before it
ever ran, moved before it got a node, or between a move and its restart in the new region) is not
stopped (there is nothing to save): its planner only sees a stop already done, so it buys nothing.
An allotment file that cannot be read is logged and the last one read stays in force (none read
yet: the job waits); a share older than the arbiter's passes is used as it is (its total still
bounds the job's spend) and said so in the log.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from fleetd.config import FleetdConfig
from fleetd.policy.observation import DesiredJob, Observation
from fleetd.policy.team_share import Share, within_share
from fleetd.protocol.errors import ProtocolError
from fleetd.reconcile.ports import NodeCommander
from fleetd.reconcile.state_port import StateBackend
from fleetd.shared.logs import get_logger
from fleetd.team.allotment_file import AllotmentRecord, read_allotment
from fleetd.team.region_mover import RegionMover

log = get_logger(__name__)

LIVE_EC2_STATES = ("pending", "running")
PAUSED_KEY = "team_paused_at"  # state-store meta: when the team's pause stopped the job


def share_of(record: AllotmentRecord) -> Share:
    return Share(record.kind, record.nodes, record.usd_per_hour, record.total_usd, record.written_at, record.reason)


def _runs(obs: Observation) -> bool:
    """Some node of the job is still up in EC2 (billed)."""
    return any(n.ec2_state in LIVE_EC2_STATES for n in obs.nodes)


def _held(obs: Observation, now: float) -> Observation:
    """The pass's observation for a job that must not train here now (paused, moving, moved).
    Something runs: the planner stops it through its coordinated checkpoint (StopJob). Nothing
    runs (a job not started yet, or resumed but never placed): there is nothing to checkpoint or
    stop, so its planner sees a stop already done and buys nothing. A StopJob there would leave a
    stop sequence waiting for nodes that never come, shut down the ones bought after the
    allotment arrives, and (between a move and the restart in the new region) count as a second
    stop of a job stopped once."""
    if obs.stop_issued_at is None and not _runs(obs):
        return replace(obs, stop_issued_at=now)
    return replace(obs, desired_job=DesiredJob.STOP)


class TeamMember:
    def __init__(
        self,
        fleet: str,
        state_dir: Path,
        state: StateBackend,
        commander: NodeCommander | None = None,
        dry_run: bool = False,
    ):
        self.fleet = fleet
        self.state_dir = Path(state_dir)
        self.state = state
        self.commander = commander
        self._share: Share | None = None
        self._region: str | None = None  # the region the last allotment read places the job in
        self._said = ""
        self.mover = RegionMover(fleet, self.state_dir, dry_run)

    async def _read(self) -> Share | None:
        try:
            record = await asyncio.to_thread(read_allotment, self.state_dir)
        except (ProtocolError, OSError) as exc:
            log.error("team_allotment_unreadable", error=str(exc)[:300], kept="the last allotment read")
            return self._share
        if record is not None and record.job != self.fleet:
            # The team's config points another job at this state directory: not this job's share.
            log.error("team_allotment_not_ours", job=record.job, fleet=self.fleet, kept="the last allotment read")
        elif record is not None:
            self._share, self._region = share_of(record), record.region
        return self._share

    async def bound(self, obs: Observation, cfg: FleetdConfig, now: float) -> tuple[Observation, FleetdConfig]:
        """This pass's observation and config inside the job's share."""
        bounded = within_share(cfg, await self._read(), now)
        if bounded.note != self._said:
            log.info("team_share", note=bounded.note, paused=bounded.paused)
            self._said = bounded.note
        paused_at = await self.state.get_meta(PAUSED_KEY)
        move_to = self.mover.target(cfg, self._region, training=not bounded.paused)
        if move_to is None:
            await self.mover.close()  # the team changed its mind mid-copy: the job stays here
        if self.mover.moved is not None:
            # Its objects are in the new region and the daemon is starting again there: nothing
            # more happens here (a resume here would train from the older checkpoint).
            return _held(obs, now), bounded.cfg
        if bounded.paused or move_to is not None:
            if obs.desired_job is DesiredJob.END:
                return obs, bounded.cfg  # the job is over: its nodes are released as for any job
            if paused_at is None:
                await self.state.set_meta(PAUSED_KEY, now)
                log.warning("team_pause", why=bounded.note, moving_to=move_to)
            held = _held(obs, now)
            if move_to is not None and not _runs(held) and held.stop_issued_at is not None:
                # Stopped, its checkpoint durable and every node gone: copy, then start over there.
                await self.mover.step(cfg, move_to, bounded.note)
            return held, bounded.cfg
        if paused_at is not None:
            if _runs(obs):
                # The stopped nodes are still shutting down: new ones join only a clean start.
                log.info("team_resume_waits", why="the paused job's nodes are still being released")
                return replace(obs, desired_job=DesiredJob.STOP), bounded.cfg
            if self.commander is not None:
                try:
                    await self.commander.resume_job(bounded.note)
                except Exception as exc:  # noqa: BLE001 - the store may be restarting: the next pass retries
                    log.warning("team_resume_retried", error=repr(exc)[:300], why="the rendezvous did not reopen")
                    return _held(obs, now), bounded.cfg
            await self.state.set_meta(PAUSED_KEY, None)
            if obs.stop_issued_at is not None:
                await self.state.set_meta("stop_issued_at", None)
                obs = replace(obs, stop_issued_at=None)
            log.warning("team_resume", paused_for_s=round(now - float(paused_at), 1), why=bounded.note)
        return obs, bounded.cfg
