"""The team demo's record and report (fleetd/demo/team_demo.py plays the story): per job its
state, region, spend and steps lost from the trainers' own step records; the pauses; the team's
spend against its budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetd.demo.launcher import Launcher
from fleetd.demo.procs import Child
from fleetd.demo.progress import Progress
from fleetd.demo.team_regions import Move

if TYPE_CHECKING:
    from fleetd.demo.runner import DemoRun


@dataclass
class TeamJob:
    name: str
    priority: int
    workdir: Path
    config: Path
    events: Path
    launcher: Launcher | None = None
    fleetd: Child | None = None


@dataclass
class Pause:
    job: str
    paused_at: float
    last_step_before: int
    released_at: float | None = None
    durable_step: int | None = None
    resumed_at: float | None = None
    resumed_from: int | None = None
    trained_past_at: float | None = None
    others_at_cut: dict[str, int] = field(default_factory=dict)  # the other jobs' steps at the cut

    @property
    def steps_lost(self) -> int | None:
        if self.resumed_from is None:
            return None
        return max(0, self.last_step_before - self.resumed_from)


@dataclass
class TeamStory:
    jobs: dict[str, TeamJob] = field(default_factory=dict)
    team: Child | None = None
    team_config: Path | None = None
    total_usd: float = 0.0
    burn_usd_per_hour: float = 0.0
    pauses: list[Pause] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)
    failure: str | None = None


def job_snapshot(job: TeamJob) -> Any:
    from fleetd.demo.view import status_snapshot

    return status_snapshot(job.workdir)


def build_team_report(run: DemoRun, story: TeamStory) -> dict[str, Any]:
    from fleetd.team.allotment_file import read_allotment

    jobs: list[dict[str, Any]] = []
    spends: list[float | None] = []
    for job in story.jobs.values():
        snap = job_snapshot(job)
        progress = Progress.load(job.events)
        allotment = read_allotment(job.workdir / "state")
        spends.append(round(snap.budget.spent_usd, 4) if snap is not None and snap.budget is not None else None)
        jobs.append(
            {
                "name": job.name,
                "priority": job.priority,
                "state": str(snap.job.state) if snap is not None and snap.job is not None else "unknown",
                # Where its daemon runs (its own status), else where its allotment places it.
                "region": (snap.region if snap is not None and snap.region else None)
                or (allotment.region if allotment is not None else None),
                "allotment": allotment.kind if allotment is not None else None,
                "final_step": progress.final_step,
                "steps_lost": sum(r.steps_lost for r in progress.restarts()),
                "spend_usd": spends[-1],
            }
        )
    team_spend = round(sum(s for s in spends if s is not None), 4) if None not in spends else None
    finals = {j["name"]: j for j in jobs}
    # The others trained on through the pause: past their step at the cut, nothing lost.
    others_on = bool(story.pauses) and all(
        finals[n]["final_step"] > step and finals[n]["steps_lost"] == 0
        for n, step in story.pauses[0].others_at_cut.items()
    )
    return {
        "scenario": "team",
        "workdir": str(run.workdir),
        "failure": story.failure,
        "jobs": jobs,
        "pauses": [
            {
                "job": p.job,
                "last_step_before": p.last_step_before,
                "durable_step": p.durable_step,
                "resumed_from": p.resumed_from,
                "steps_lost": p.steps_lost,
                "released_after_s": round(p.released_at - p.paused_at, 1) if p.released_at else None,
                "training_again_after_s": (
                    round(p.trained_past_at - p.released_at, 1) if p.trained_past_at and p.released_at else None
                ),
            }
            for p in story.pauses
        ],
        "region_moves": [m.as_dict() for m in story.moves],
        "team_spend_usd": team_spend,
        "team_budget_usd": story.total_usd,
        "others_trained_on": others_on,
        "story_told": (
            story.failure is None
            and bool(story.pauses)
            and story.pauses[0].steps_lost == 0
            and bool(story.moves)
            and all(m.steps_lost == 0 and m.moved_to is not None for m in story.moves)
            and others_on
            and team_spend is not None
            and team_spend <= story.total_usd
        ),
    }


def render_team(report: dict[str, Any]) -> str:
    lines = [f"{'job':<8} {'prio':>4} {'state':<11} {'final step':>10} {'steps lost':>10} {'spend $':>9}"]
    for j in report["jobs"]:
        spend = "unknown" if j["spend_usd"] is None else f"{j['spend_usd']:.4f}"
        lines.append(
            f"{j['name']:<8} {j['priority']:>4} {j['state']:<11} {j['final_step']:>10} {j['steps_lost']:>10} {spend:>9}"
        )
    for p in report["pauses"]:
        lines.append(
            f"pause of {p['job']}: last step {p['last_step_before']}, durable {p['durable_step']}, resumed from "
            f"{p['resumed_from']} ({p['steps_lost']} steps lost); node released {p['released_after_s']} s after "
            f"the cut, training again {p['training_again_after_s']} s after that"
        )
    for m in report["region_moves"]:
        lines.append(
            f"move of {m['job']}: {m['from']} -> {m['to']} ({m['objects_copied']} objects copied "
            f"{m['copied_after_s']} s after the withdrawal), resumed from {m['resumed_from']} in "
            f"{m['resumed_in_zone']} ({m['steps_lost']} steps lost), training again "
            f"{m['training_again_after_s']} s after the withdrawal"
        )
    spend = report["team_spend_usd"]
    lines.append(f"team spend {'unknown' if spend is None else f'${spend:.4f}'} of ${report['team_budget_usd']:.2f}")
    if report["failure"]:
        lines.append(f"the story was not told: {report['failure']}")
    return "\n".join(lines)
