"""What a rendezvous store crash costs the job: store back -> training again, and steps lost.

Real torchrun (CPU, gloo) on 127.0.0.x nodes, each supervised by the agent's own code
(``agent.supervise.elastic_hooks.ElasticHooks.run``), the real ``fleetd rendezvous`` host and
fleetd's steering process. ``--trials`` times, at a random moment while all nodes train, the host
is SIGKILLed (as the OOM killer would) and started again on the same port after ``--down-s``
(systemd's ``RestartSec`` plus its start, which imports torch: seconds), empty. Per trial:

- store back -> training: from the host listening again to every rank having completed a step
  after it (with the ride-through, agent/supervise/store_ride.py, they never stopped);
- store back -> reattached: to rank 0 reading the new store again (checkpoint requests and
  progress reach fleetd again);
- longest no-step gap from the kill to 10 s after the store is back (or every rank's step again);
- steps lost: last step completed before the kill - the step the job resumed from (0 when no
  worker restarted);
- torchrun restarts by the agents (0 with the ride-through).

``--outage-bound 0.5`` makes torchrun give up on the store at once (FLEETD_STORE_OUTAGE_S): the
old path (every torchrun restarts once the store is back, resume from the salvaged step), for a
like-for-like comparison.

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


async def trial(
    cluster: LocalCluster, nodes: list[str], hooks: dict[str, ElasticHooks], down_s: float, settle_s: float
) -> dict:
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
    try:
        t_train: float | None = await asyncio.to_thread(cluster.events.wait_training, world, t_back, 300, set(nodes))
    except TimeoutError:
        t_train = None
    await asyncio.sleep(max(0.0, t_back + 10.0 - time.time()))
    steps = cluster.events.of("step")
    before = [e for e in steps if e["t"] < t_kill + 0.5]
    last_before = max((e["step"] for e in before), default=0)
    until = max(t_back + 10.0, t_train or 0.0)  # through the first step every rank made again
    window = sorted(e["t"] for e in steps if t_kill - 1.0 <= e["t"] <= until)
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    resumed = [e["from_step"] for e in cluster.events.of("resumed") if e["t"] >= t_kill]
    reattached = [e["t"] for e in cluster.events.of("store_generation") if e["t"] >= t_kill]
    return {
        "store_back_to_training_s": round(t_train - t_back, 2) if t_train is not None else None,
        "store_back_to_reattached_s": round(min(reattached) - t_back, 2) if reattached else None,
        "longest_no_step_s": round(max(gaps), 2) if gaps else None,
        "store_down_s": round(t_back - t_kill, 2),
        "steps_lost": max(0, last_before - min(resumed)) if resumed else 0,
        "torchrun_restarts": sum(h.starts - starts_before[a] for a, h in hooks.items()),
        "load": round(os.getloadavg()[0], 1),
    }


async def main_async(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    nodes = [f"127.0.0.{2 + i}" for i in range(args.nodes)]
    env = {"FLEETD_STORE_OUTAGE_S": str(args.outage_bound)} if args.outage_bound is not None else {}
    cluster = LocalCluster(
        work, run_id="bench", min_nodes=1, max_nodes=len(nodes) + 1, train_args=TRAIN_ARGS, extra_env=env
    )
    rows: list[dict] = []
    rng = random.Random(args.seed)
    try:
        with cluster:
            await asyncio.to_thread(cluster.start_host)
            cluster.start_steering()
            hooks = {
                a: ElasticHooks(
                    spec=cluster.spec(a),
                    instance_id=f"i-{a}",
                    publish_event=_ignore,
                    set_state=_ignore,
                    log_path=work / "nodes" / a / "torchrun.log",
                )
                for a in nodes
            }
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
    back = [r["store_back_to_training_s"] for r in rows if r["store_back_to_training_s"] is not None]
    lost = [r["steps_lost"] for r in rows]
    never = sum(1 for r in rows if r["store_back_to_training_s"] is None)
    return {
        "bench": "store_restart",
        "nodes": len(nodes),
        "trials": len(rows),
        "down_s": args.down_s,
        "outage_bound_s": args.outage_bound,
        "store_back_to_training_s": {
            "p50": statistics.median(back) if back else None,
            "max": max(back) if back else None,
            "all": back,
        },
        "store_back_to_reattached_s": [r["store_back_to_reattached_s"] for r in rows],
        "longest_no_step_s": [r["longest_no_step_s"] for r in rows],
        "store_down_s": [r["store_down_s"] for r in rows],
        "steps_lost": {"max": max(lost) if lost else None, "all": lost},
        "torchrun_restarts": [r["torchrun_restarts"] for r in rows],
        "never_resumed": never,
        "target_store_back_to_training_s": TARGET_S,
        "target_met": bool(rows) and never == 0 and max(back) <= TARGET_S and max(lost) <= TARGET_STEPS,
        "load_avg": [r["load"] for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--down-s", type=float, default=1.0, help="seconds the host stays dead (systemd RestartSec)")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument(
        "--outage-bound",
        type=float,
        default=None,
        help="FLEETD_STORE_OUTAGE_S for torchrun (default: its own, 120 s); 0.5 = the old restart path",
    )
    result = asyncio.run(main_async(p.parse_args()))
    b = result["store_back_to_training_s"]
    print(f"{'store back -> training (s)':<28} p50 {b['p50']}  max {b['max']}  (target {TARGET_S:g})")
    print(f"{'steps lost':<28} max {result['steps_lost']['max']}  (target {TARGET_STEPS})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
