"""How long a membership change costs the training job, fleetd-steered vs plain torchrun.

One run, real torchrun (CPU, gloo), nodes on 127.0.0.x, checkpoints to a local moto S3:

steered (fleetd): 3 nodes; then ``--cycles`` times: a spot notice on one node (coordinated
  checkpoint, shard upload, leave, survivors re-form) and a new node joining.
  - notice -> all survivors training again: from the notice (the emergency path starting) to the
    moment every survivor rank has completed a step at the new world size;
  - notice -> leaver stopped: the leaving node's own time to its tree stopped (fleetd then
    terminates it): the part of a notice it is billed for;
  - steps lost: (last step completed before the change) - (step resumed from);
  - join -> training: from the new node's torchrun starting to every rank having completed a step
    at the larger world size.
  Then two losses without notice: a node frozen (SIGSTOP: its peers' collectives hang, as when a
  machine vanishes) and a node SIGKILLed (its sockets close, its peers' collectives fail):
  - loss -> survivors training again, and steps lost (the survivors save the step they completed,
    agent/trainer/salvage.py).
default (plain torchrun defaults, no fleetd): 3 nodes; a node is terminated at the notice
  (SIGTERM, the best case for a node that does nothing with its notice), then a node joins, then a
  node is frozen (nothing pokes the survivors: they hang until gloo's collective timeout, 30 min
  by default; the bench gives up after ``--hang-limit-s``).

Prints a table, and as the last line one JSON object. Run: ``.venv/bin/python bench/rebalance.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.checkpoint_store import CheckpointStore  # noqa: E402
from agent.supervise.emergency import CheckpointStoreUploader, EmergencyFlow  # noqa: E402
from agent.trainer.store_link import StoreLink  # noqa: E402
from fleetd.rendezvous.localcluster import LocalCluster  # noqa: E402
from fleetd.shared.settings import AwsConfig, CheckpointConfig  # noqa: E402

BUCKET = "bench-rebalance"
TRAIN_ARGS = ("--steps", "1000000", "--step-sleep", "0.05")


def _last_before(cluster: LocalCluster, world: int, until: float) -> int:
    steps = [e["step"] for e in cluster.events.of("step", world=world) if e["t"] < until]
    return max(steps) if steps else 0


def _resumed(cluster: LocalCluster, world: int, since: float) -> int:
    got = [e["from_step"] for e in cluster.events.of("resumed", world=world) if e["t"] >= since]
    return min(got) if got else 0


def _first_step_at(cluster: LocalCluster, world: int, since: float, nodes: set[str]) -> float:
    return min(cluster.events.training_at(world, since, nodes).values())


async def steered(workdir: Path, endpoint: str, cycles: int) -> dict:
    cluster = LocalCluster(
        workdir,
        run_id="bench",
        min_nodes=1,
        max_nodes=8,
        ckpt_interval=50,
        train_args=TRAIN_ARGS,
        s3_bucket=BUCKET,
        s3_endpoint=endpoint,
    )
    cfg = CheckpointConfig(bucket=BUCKET, prefix=cluster.s3_prefix, local_dir=workdir / "agent")
    aws = AwsConfig(region="us-east-1", endpoint_url=endpoint)
    out: dict = {
        "notice_s": [],
        "left_s": [],
        "steps_lost": [],
        "join_s": [],
        "join_pause_s": [],
        "join_steps_lost": [],
        "phases": [],
    }
    try:
        async with CheckpointStore.connect(cfg, aws, job="bench") as store:
            await store.ensure_bucket()
            cluster.start_host()
            cluster.start_steering()
            live = [f"127.0.0.{i}" for i in (2, 3, 4)]
            t0 = time.time()
            for addr in live:
                cluster.add_node(addr)
            await asyncio.to_thread(cluster.events.wait_training, 3, t0, 180, set(live))
            link = await asyncio.to_thread(StoreLink(cluster.host, cluster.port, cluster.run_id).connect)
            next_addr = 5
            for _ in range(cycles):
                await asyncio.sleep(2.0)
                leaving = live[-1]
                flow = EmergencyFlow(
                    link,
                    leaving,
                    cluster.nodes[leaving],
                    cluster.spec(leaving).ckpt_dir,
                    uploader=CheckpointStoreUploader(store, writer=leaving),
                )
                t_notice = time.time()
                outcome = await flow.run(reason="spot notice (bench)")
                cluster.nodes.pop(leaving)
                live.remove(leaving)
                t_done = await asyncio.to_thread(cluster.events.wait_training, len(live), t_notice, 120, set(live))
                first = _first_step_at(cluster, len(live), t_notice, set(live))
                lost = _last_before(cluster, len(live) + 1, first) - _resumed(cluster, len(live), t_notice)
                out["notice_s"].append(round(t_done - t_notice, 3))
                out["left_s"].append(outcome.timings.get("stopped"))
                out["steps_lost"].append(lost)
                out["phases"].append({"emergency": outcome.timings, "durable": outcome.durable})

                await asyncio.sleep(2.0)
                joining = f"127.0.0.{next_addr}"
                next_addr += 1
                t_join = time.time()
                cluster.add_node(joining)
                live.append(joining)
                t_done = await asyncio.to_thread(cluster.events.wait_training, len(live), t_join, 120, set(live))
                first = _first_step_at(cluster, len(live), t_join, set(live))
                out["join_s"].append(round(t_done - t_join, 3))
                # What the join costs the running ranks: their last step at the old size to every
                # rank training at the new one (the newcomer's own start-up is not their pause).
                old = [e["t"] for e in cluster.events.of("step", world=len(live) - 1) if e["t"] >= t_join]
                out["join_pause_s"].append(round(t_done - max(old, default=t_join), 3))
                out["join_steps_lost"].append(
                    _last_before(cluster, len(live) - 1, first) - _resumed(cluster, len(live), t_join)
                )

            for how in ("frozen", "killed"):
                await asyncio.sleep(2.0)
                gone = live.pop()
                t_loss = time.time()
                await asyncio.to_thread(cluster.freeze_node if how == "frozen" else cluster.kill_node, gone)
                t_done = await asyncio.to_thread(cluster.events.wait_training, len(live), t_loss, 120, set(live))
                first = _first_step_at(cluster, len(live), t_loss, set(live))
                out[f"{how}_s"] = round(t_done - t_loss, 3)
                out[f"{how}_steps_lost"] = _last_before(cluster, len(live) + 1, first) - _resumed(
                    cluster, len(live), t_loss
                )
    finally:
        await asyncio.to_thread(cluster.close)
    return out


def default(workdir: Path, hang_limit_s: float) -> dict:
    cluster = LocalCluster(
        workdir,
        run_id="bench-default",
        min_nodes=1,
        max_nodes=8,
        ckpt_interval=50,
        train_args=TRAIN_ARGS,
        steered=False,
    )
    out: dict = {}
    try:
        cluster.start_host()  # the store still lives outside the nodes; no steering process
        live = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        t0 = time.time()
        for addr in live:
            cluster.add_node(addr)
        cluster.events.wait_training(3, t0, 240, set(live))
        time.sleep(2.0)
        leaving = live.pop()
        t_notice = time.time()
        proc = cluster.nodes.pop(leaving)
        proc.terminate(timeout_s=30)  # the instance shuts down: systemd SIGTERMs torchrun
        proc.wait_blocking()
        t_done = cluster.events.wait_training(2, t_notice, 240, set(live))
        first = _first_step_at(cluster, 2, t_notice, set(live))
        out["notice_s"] = round(t_done - t_notice, 3)
        out["steps_lost"] = _last_before(cluster, 3, first) - _resumed(cluster, 2, t_notice)
        time.sleep(2.0)
        t_join = time.time()
        cluster.add_node("127.0.0.5")
        live.append("127.0.0.5")
        t_done = cluster.events.wait_training(3, t_join, 240, set(live))
        first = _first_step_at(cluster, 3, t_join, set(live))
        out["join_s"] = round(t_done - t_join, 3)
        out["join_steps_lost"] = _last_before(cluster, 2, first) - _resumed(cluster, 3, t_join)
        time.sleep(2.0)
        gone = live.pop()
        t_loss = time.time()
        cluster.freeze_node(gone)
        try:
            out["frozen_s"] = round(cluster.events.wait_training(2, t_loss, hang_limit_s, set(live)) - t_loss, 3)
        except TimeoutError:
            out["frozen_s"] = None  # still hung: nothing tells torchrun's agents the peer is gone
    finally:
        cluster.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=2, help="notice+join cycles in the steered run")
    p.add_argument("--skip-default", action="store_true", help="skip the plain-torchrun comparison")
    p.add_argument(
        "--hang-limit-s",
        type=float,
        default=60.0,
        help="how long to wait for plain torchrun's survivors of a frozen peer",
    )
    args = p.parse_args()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    workdir = Path(tempfile.mkdtemp(prefix="fleetd-bench-rebalance-"))
    load_before = os.getloadavg()[0]
    try:
        s = asyncio.run(steered(workdir / "steered", f"http://{host}:{port}", args.cycles))
        d = {} if args.skip_default else default(workdir / "default", args.hang_limit_s)
    finally:
        moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    print(f"cpus={os.cpu_count()} load average before={load_before:.1f} after={os.getloadavg()[0]:.1f}")
    print(f"{'event':38} {'fleetd':>12} {'torchrun defaults':>18}")
    print(f"{'notice -> all survivors training (s)':38} {med(s['notice_s']):>12} {d.get('notice_s', '-'):>18}")
    print(f"{'notice -> leaver stopped (s)':38} {med(s['left_s']):>12} {'-':>18}")
    print(f"{'steps lost per notice':38} {max(s['steps_lost']):>12} {d.get('steps_lost', '-'):>18}")
    print(f"{'join -> all ranks training (s)':38} {med(s['join_s']):>12} {d.get('join_s', '-'):>18}")
    print(f"{'join: running ranks paused (s)':38} {med(s['join_pause_s']):>12} {'-':>18}")
    print(f"{'steps lost per join':38} {max(s['join_steps_lost']):>12} {d.get('join_steps_lost', '-'):>18}")
    hung = f"> {args.hang_limit_s:g} (hung)" if not args.skip_default and d.get("frozen_s") is None else "-"
    print(f"{'frozen node -> survivors training (s)':38} {s['frozen_s']:>12} {d.get('frozen_s') or hung:>18}")
    print(f"{'steps lost per frozen node':38} {s['frozen_steps_lost']:>12} {'-':>18}")
    print(f"{'killed node -> survivors training (s)':38} {s['killed_s']:>12} {'-':>18}")
    print(f"{'steps lost per killed node':38} {s['killed_steps_lost']:>12} {'-':>18}")
    print(f"samples: notice {s['notice_s']}  join {s['join_s']}  join pause {s['join_pause_s']}")
    for i, ph in enumerate(s["phases"]):
        print(
            f"notice {i + 1}: emergency path phases (s since notice) {ph['emergency']}, shard durable={ph['durable']}"
        )
    result = {
        "notice_to_training_s": med(s["notice_s"]),
        # The leaver's own time, notice -> its tree stopped (then fleetd terminates it).
        "notice_to_left_s": med(s["left_s"]),
        "steps_lost": max(s["steps_lost"]),
        "join_to_training_s": med(s["join_s"]),
        "join_pause_s": med(s["join_pause_s"]),
        "join_steps_lost": max(s["join_steps_lost"]),
        "default_notice_to_training_s": d.get("notice_s"),
        "default_steps_lost": d.get("steps_lost"),
        "default_join_to_training_s": d.get("join_s"),
        "frozen_to_training_s": s["frozen_s"],
        "frozen_steps_lost": s["frozen_steps_lost"],
        "killed_to_training_s": s["killed_s"],
        "killed_steps_lost": s["killed_steps_lost"],
        "default_frozen_to_training_s": d.get("frozen_s"),
        "default_hang_limit_s": None if args.skip_default else args.hang_limit_s,
        "notice_samples_s": s["notice_s"],
        "join_samples_s": s["join_s"],
        "join_pause_samples_s": s["join_pause_s"],
        "cpus": os.cpu_count(),
        "load_average_before": round(load_before, 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
