"""Chaos bench: faults at random moments against the real demo stack, invariants after each.

The stack is `fleetd demo`'s (bench/chaos_stack.py): moto (EC2 and S3) behind the fault proxy,
mosquitto, `fleetd rendezvous`, `fleetd run`, and local nodes (fake IMDS + real fleet-agent + real
torchrun on CPU/gloo). Once training runs, ``--faults N`` times (default 50) after a random pause
and once training is steady again (so what follows a fault is that fault's doing),
one fault of a kind drawn in a seeded shuffle (every kind about equally often):

    fleetd-run, rendezvous, mosquitto   SIGKILL (2 in 3) or SIGTERM, started again 1-5 s later
    agent                               SIGKILL, leftovers killed, started again (systemd)
    worker                              one torchrun worker SIGKILLed
    node                                the node's whole process tree SIGKILLed (silent loss)
    ec2-throttle                        every EC2 call throttled for 10-30 s
    s3-drop                             1-3 S3 uploads cut mid-body

After each fault (bench/chaos_checks.py):
- training steady again: a stretch of ``--window`` s of steps without a gap over ``--gap`` s
  must begin within the kind's bound (bench/chaos_faults.py KINDS); recovery seconds are from the
  injection to that stretch's start (0: training never paused). For ec2-throttle recovery is from
  the release to fleetd's next DescribeInstances; for s3-drop, to the next checkpoint ``latest``
  names. Not within the bound: ``never_resumed``;
- steps lost (the highest step done before the fault minus the step the world that next went past
  it resumed from: work done again) within the bound;
- orphans: live fleet instances in EC2 that fleetd's state DB has no open record of (still so
  10 s later);
- every step ``latest`` names restores and verifies (manifest and every file's SHA-256);
- spend <= budget (fleetd's status snapshot).
All run long, sampled every 3 s: duplicates (more active nodes than the fleet's maximum, or a
launch token holding more instances than asked). After the run: no stray process (every process
the bench starts inherits a marker in its environment).

Prints a table of fault kind x outcome, and as the last line one JSON object.
Run: ``nice .venv/bin/python bench/chaos.py [--faults 50] [--seed 1] [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos_checks import (  # noqa: E402
    DuplicateWatch,
    EventTail,
    checkpoint_check,
    orphan_candidates,
    resumptions,
    spend,
    steady_now,
    steps_lost,
    strays,
    training_again_at,
)
from bench.chaos_faults import KINDS, Injected, NoTarget, inject  # noqa: E402
from bench.chaos_stack import Stack  # noqa: E402

MARKER = "FLEETD_CHAOS_RUN"


def schedule(n: int, kinds: list[str], rng: random.Random) -> list[str]:
    """Every kind about equally often, in a seeded random order."""
    out: list[str] = []
    while len(out) < n:
        batch = list(kinds)
        rng.shuffle(batch)
        out += batch
    return out[:n]


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.rng = random.Random(args.seed)
        self.stack = Stack(workdir, args.nodes, args.budget)
        self.tail = EventTail(workdir / "trainer-events.jsonl")
        self.dups = DuplicateWatch(max_nodes=args.nodes + 1)
        self.results: list[dict] = []
        self.checks: list[str] = []  # invariant failures, one line each

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    async def wait_steady(self, after: float, until: float) -> float | None:
        while time.time() < until:
            await asyncio.sleep(1.0)
            self.tail.poll()
            t = training_again_at(self.tail.steps(), after, time.time(), self.args.window, self.args.gap)
            if t is not None:
                return t
        return None

    async def until_steady_now(self, limit_s: float) -> bool:
        deadline = time.time() + limit_s
        while True:
            self.tail.poll()
            if steady_now(self.tail.steps(), time.time(), self.args.window, self.args.gap):
                return True
            if time.time() > deadline:
                return False
            await asyncio.sleep(1.0)

    async def sample_duplicates(self) -> None:
        while True:
            try:
                self.dups.sample(await self.stack.describe(), self.stack.state_db)
            except Exception as exc:  # noqa: BLE001 (moto busy: the next sample retries)
                self.log(f"duplicate sample failed: {exc!r}")
            await asyncio.sleep(3.0)

    async def observe(self, inj: Injected) -> dict:
        kind = KINDS[inj.kind]
        deadline = inj.at + kind.recovery_bound_s
        steady: float | None = None
        metric: float | None = None
        while time.time() < deadline + self.args.window:
            await asyncio.sleep(1.0)
            self.tail.poll()
            now = time.time()
            if steady is None:
                t = training_again_at(self.tail.steps(), inj.at, now, self.args.window, self.args.gap)
                steady = t if t is not None and t <= deadline else None
            if inj.recovered is not None and metric is None and now <= deadline:
                metric = await inj.recovered()
            if steady is not None and (inj.recovered is None or metric is not None):
                break
            if now > deadline and steady is None and (inj.recovered is None or metric is None):
                break
        if inj.recovered is not None:
            ok = steady is not None and metric is not None
            base = inj.ended_at if inj.kind == "ec2-throttle" else inj.at
            recovery = round(metric - base, 2) if metric is not None else None
        else:
            ok = steady is not None
            recovery = round(steady - inj.at, 2) if steady is not None else None
        lost = steps_lost(self.tail.records, inj.at, time.time())
        out = {
            "kind": inj.kind,
            "how": inj.how,
            "target": inj.target,
            "at": round(inj.at, 2),
            "resumed": ok,
            "recovery_s": recovery,
            "steps_lost": lost,
            "steps_over_bound": lost > kind.steps_lost_bound,
            "notes": list(inj.notes),
        }
        if lost:
            out["resumptions"] = resumptions(self.tail.records, inj.at, time.time())
        out.update(await self.invariants())
        return out

    async def invariants(self) -> dict:
        instances = await self.stack.describe()
        orphans = orphan_candidates(instances, self.stack.state_db)
        if orphans:
            await asyncio.sleep(10.0)  # a launch fleetd is recording right now is not an orphan
            orphans &= orphan_candidates(await self.stack.describe(), self.stack.state_db)
        ok, detail, _ = await checkpoint_check(self.stack)
        spent, total = spend(self.stack.workdir)
        over = spent is not None and total is not None and spent > total
        for bad, line in (
            (orphans, f"orphans {sorted(orphans)}"),
            (not ok, f"checkpoint: {detail}"),
            (over, f"spend {spent} > budget {total}"),
        ):
            if bad:
                self.checks.append(line)
        return {
            "orphans": sorted(orphans),
            "checkpoint_ok": ok,
            "checkpoint": detail,
            "spent_usd": spent,
            "over_budget": over,
        }

    async def run(self) -> dict:
        started = time.time()
        sampler: asyncio.Task | None = None
        try:
            await self.stack.start()
            self.log(f"stack up in {self.stack.workdir}; waiting for training")
            first = await self.wait_steady(time.time(), time.time() + self.args.setup_timeout)
            if first is None:
                return {"error": f"training did not start in {self.args.setup_timeout:.0f} s; see {self.stack.workdir}"}
            self.log(f"training steadily (step {self.tail.last_step()})")
            sampler = asyncio.create_task(self.sample_duplicates())
            for i, kind in enumerate(schedule(self.args.faults, self.args.kinds, self.rng)):
                await asyncio.sleep(self.rng.uniform(*self.args.pause))
                # Each fault starts from steady training, so what follows it is its own doing.
                unsteady = not await self.until_steady_now(180.0)
                inj = await self.inject(kind)
                if inj is None:
                    self.results.append({"kind": kind, "skipped": True})
                    continue
                if unsteady:
                    inj.notes.append("training was not steady before this fault (180 s wait)")
                res = await self.observe(inj)
                self.results.append(res)
                self.log(
                    f"fault {i + 1}/{self.args.faults} {kind} ({inj.how}, {inj.target}): "
                    f"resumed={res['resumed']} recovery_s={res['recovery_s']} steps_lost={res['steps_lost']} "
                    f"step={self.tail.last_step()}"
                    + (f" [{'; '.join(res['resumptions'])}]" if res["steps_lost"] else "")
                )
            settled = await self.wait_steady(time.time(), time.time() + 120.0)
            final = await self.invariants()
        finally:
            if sampler is not None:
                sampler.cancel()
            await self.stack.stop()
            await asyncio.sleep(2.0)
        left = strays(MARKER, os.environ[MARKER])
        return self.summary(started, final, settled is not None, left)

    async def inject(self, kind: str) -> Injected | None:
        for _ in range(12):
            try:
                return await inject(kind, self.stack, self.rng)
            except NoTarget as exc:
                self.log(f"{kind}: {exc}; waiting")
                await asyncio.sleep(5.0)
        return None

    def summary(self, started: float, final: dict, settled: bool, left: list[str]) -> dict:
        done = [r for r in self.results if not r.get("skipped")]
        per_kind: dict[str, dict] = {}
        for kind in self.args.kinds:
            rs = [r for r in done if r["kind"] == kind]
            rec = sorted(r["recovery_s"] for r in rs if r["recovery_s"] is not None)
            per_kind[kind] = {
                "count": len(rs),
                "resumed": sum(r["resumed"] for r in rs),
                "never_resumed": sum(not r["resumed"] for r in rs),
                "recovery_s_p50": _pct(rec, 50),
                "recovery_s_p99": _pct(rec, 99),
                "steps_lost": sum(r["steps_lost"] for r in rs),
                "steps_lost_max": max((r["steps_lost"] for r in rs), default=0),
                "steps_over_bound": sum(r["steps_over_bound"] for r in rs),
                "recovery_bound_s": KINDS[kind].recovery_bound_s,
                "steps_lost_bound": KINDS[kind].steps_lost_bound,
            }
        orphans = set(final["orphans"]).union(*(set(r["orphans"]) for r in done)) if done else set(final["orphans"])
        return {
            "faults": len(done),
            "skipped": len(self.results) - len(done),
            "orphans": len(orphans),
            "duplicates": len(self.dups.excess),
            "never_resumed": sum(not r["resumed"] for r in done),
            "steps_over_bound": sum(r["steps_over_bound"] for r in done),
            "over_budget": int(final["over_budget"] or any(r["over_budget"] for r in done)),
            "checkpoint_incomplete": sum(not r["checkpoint_ok"] for r in done) + int(not final["checkpoint_ok"]),
            "stray_processes": len(left),
            "steady_at_end": settled,
            "final_step": self.tail.last_step(),
            "spent_usd": final["spent_usd"],
            "budget_usd": self.args.budget,
            "duration_s": round(time.time() - started, 1),
            "seed": self.args.seed,
            "nodes": self.args.nodes,
            "per_kind": per_kind,
            "invariant_failures": self.checks[:50] + self.dups.notes[:20] + [f"stray: {s}" for s in left[:20]],
            "workdir": str(self.stack.workdir),
            "faults_detail": self.results,
        }


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1], 2)


def table(s: dict) -> str:
    head = f"{'fault':<14}{'count':>6}{'resumed':>9}{'never':>7}{'rec p50 s':>11}{'rec p99 s':>11}{'lost':>7}{'lost max':>10}{'>bound':>8}"
    lines = [head, "-" * len(head)]
    for kind, k in s["per_kind"].items():

        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        lines.append(
            f"{kind:<14}{k['count']:>6}{k['resumed']:>9}{k['never_resumed']:>7}{f(k['recovery_s_p50']):>11}"
            f"{f(k['recovery_s_p99']):>11}{k['steps_lost']:>7}{k['steps_lost_max']:>10}{k['steps_over_bound']:>8}"
        )
    lines.append(
        f"faults {s['faults']}  orphans {s['orphans']}  duplicates {s['duplicates']}  never_resumed "
        f"{s['never_resumed']}  over_budget {s['over_budget']}  checkpoint_incomplete "
        f"{s['checkpoint_incomplete']}  stray_processes {s['stray_processes']}  final step {s['final_step']}"
    )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="CI: 2 nodes, short pauses and windows")
    p.add_argument("--nodes", type=int, default=None, help="nodes the fleet asks for (default 3, quick 2)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    p.add_argument("--budget", type=float, default=50.0)
    p.add_argument("--window", type=float, default=None, help="steady-training window, s (default 10, quick 8)")
    p.add_argument("--gap", type=float, default=4.0, help="a pause between steps longer than this is a stop, s")
    p.add_argument("--setup-timeout", type=float, default=300.0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    args.nodes = args.nodes or (2 if args.quick else 3)
    args.window = args.window or (8.0 if args.quick else 10.0)
    args.pause = (1.0, 3.0) if args.quick else (1.0, 6.0)
    return args


async def _until_signalled(work) -> dict:
    """SIGTERM/SIGINT cancel the run, so its stack is still stopped (no stray process)."""
    import signal

    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return {"error": "stopped by a signal before the end"}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from fleetd.shared.logs import configure_logging

    configure_logging("warning", stream=sys.stderr)  # stdout: the table, then the JSON line
    os.environ[MARKER] = uuid.uuid4().hex  # inherited by everything the bench starts
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetd-chaos-"))
    summary = asyncio.run(_until_signalled(Chaos(args, workdir).run()))
    if "error" not in summary:
        print(table(summary))
    line = json.dumps(summary)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 1 if "error" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
