"""What a rendezvous store crash costs the job: store back -> training again, and steps lost.

Real torchrun (CPU, gloo) on 127.0.0.x nodes, each supervised by the agent's own code
(``agent.supervise.elastic_hooks.ElasticHooks.run``), the real ``fleetd rendezvous`` host and
fleetd's steering process. ``--trials`` times, at a random moment while all nodes train, the host
is SIGKILLed (as the OOM killer would) and started again on the same port after ``--down-s``
(systemd's ``RestartSec`` plus its start), empty. Per trial:

- store back -> training: from the host listening again to every rank having completed a step;
- no-step time: last step before the kill -> first step after;
- steps lost: last step completed before the kill - the step the job resumed from (the workers
  save the step they completed when the store dies: agent/trainer/salvage.py).

Issue 14's targets: <= 15 s store back -> training, <= 1 step lost with replicated state. On a
busy 2-core box the torch imports dominate: the load average is printed with each trial.

Prints a table, and as the last line one JSON object. Run: ``.venv/bin/python bench/store_restart.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.supervise.elastic_hooks import ElasticHooks  # noqa: E402
from fleetd.rendezvous.localcluster import LocalCluster  # noqa: E402

TRAIN_ARGS = ("--steps", "1000000", "--step-sleep", "0.05")
TARGET_S, TARGET_STEPS = 15.0, 1


async def _ignore(*_: object) -> None:
    return None


async def trial(cluster: LocalCluster, nodes: list[str], hooks: dict[str, ElasticHooks], down_s: float,
                settle_s: float) -> dict:
    world = len(nodes)
    await asyncio.sleep(settle_s)
    starts_before = {a: h.starts for a, h in hooks.items()}
    proc = cluster.rdzv_host_proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    t_kill = time.time()
    proc.wait()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(cluster.start_host)  # returns once the store listens again
    t_back = time.time()
    t_train = await asyncio.to_thread(cluster.events.wait_training, world, t_back, 300, set(nodes))
    steps = cluster.events.of("step")
    before = [e for e in steps if e["t"] < t_kill + 0.5]
    last_before = max((e["step"] for e in before), default=0)
    last_before_t = max((e["t"] for e in before), default=t_kill)
    first_after = min((e["t"] for e in steps if e["t"] > t_back), default=t_train)
    resumed = [e["from_step"] for e in cluster.events.of("resumed") if e["t"] >= t_kill]
    return {
        "store_back_to_training_s": round(t_train - t_back, 2),
        "no_step_s": round(first_after - last_before_t, 2),
        "steps_lost": max(0, last_before - min(resumed)) if resumed else None,
        "restarted_by_agents": all(h.starts > starts_before[a] for a, h in hooks.items()),
        "load": round(os.getloadavg()[0], 1),
    }


async def main_async(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    nodes = [f"127.0.0.{2 + i}" for i in range(args.nodes)]
    cluster = LocalCluster(work, run_id="bench", min_nodes=1, max_nodes=len(nodes) + 1, train_args=TRAIN_ARGS)
    rows: list[dict] = []
    rng = random.Random(args.seed)
    try:
        with cluster:
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            hooks = {a: ElasticHooks(spec=cluster.spec(a), instance_id=f"i-{a}", publish_event=_ignore,
                                     set_state=_ignore, log_path=work / "nodes" / a / "torchrun.log")
                     for a in nodes}
            runs = [asyncio.create_task(h.run()) for h in hooks.values()]
            try:
                t0 = time.time()
                await asyncio.to_thread(cluster.events.wait_training, len(nodes), t0, 300, set(nodes))
                for i in range(args.trials):
                    row = await trial(cluster, nodes, hooks, args.down_s, rng.uniform(3.0, 8.0))
                    rows.append(row)
                    print(f"trial {i + 1}: {row}", file=sys.stderr, flush=True)
            finally:
                for h in hooks.values():
                    await h.stop()
                for t in runs:
                    t.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir kept: {work}", file=sys.stderr)
    back = [r["store_back_to_training_s"] for r in rows]
    lost = [r["steps_lost"] for r in rows if r["steps_lost"] is not None]
    return {
        "bench": "store_restart",
        "nodes": len(nodes),
        "trials": len(rows),
        "down_s": args.down_s,
        "store_back_to_training_s": {"p50": statistics.median(back), "max": max(back), "all": back},
        "no_step_s": {"p50": statistics.median(r["no_step_s"] for r in rows), "all": [r["no_step_s"] for r in rows]},
        "steps_lost": {"max": max(lost) if lost else None, "all": lost},
        "never_resumed": sum(1 for r in rows if not r["restarted_by_agents"]),
        "target_store_back_to_training_s": TARGET_S,
        "target_met": max(back) <= TARGET_S and bool(lost) and max(lost) <= TARGET_STEPS,
        "load_avg": [r["load"] for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--down-s", type=float, default=1.0, help="seconds the host stays dead (systemd RestartSec)")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    result = asyncio.run(main_async(p.parse_args()))
    print(f"{'store back -> training (s)':<28} p50 {result['store_back_to_training_s']['p50']:.1f}  "
          f"max {result['store_back_to_training_s']['max']:.1f}  (target {TARGET_S:g})")
    print(f"{'steps lost':<28} max {result['steps_lost']['max']}  (target {TARGET_STEPS})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
