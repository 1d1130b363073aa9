"""fleetd with N simulated agents on a real broker, measured end to end.

    nice .venv/bin/python bench/agents_load.py --agents 2000 [--duration 120] [--notice-rate 0.5]

What runs (bench/load_stack.py): moto server holding N running spot instances tagged as the
fleet's (run_instances), the fault proxy in front of it (price APIs), a real mosquitto, `fleetd
rendezvous` and `fleetd run` as real processes; N agents (bench/load_agents.py, several
processes, one MQTT connection each, the real wire models: retained status with the offline
last will, telemetry at 1 Hz, events); an observer client on the broker.

After fleetd's first pass has adopted the N instances and every agent is connected, notices
arrive at ``--notice-rate`` per second for ``--duration`` seconds. Measured in that window:
notice on the broker -> drain command on the broker (the observer stamps both), reconcile pass
time (fleetd's ``pass_done`` log lines), CPU and peak RSS of fleetd, mosquitto and moto, messages
rejected by fleetd's intake (the observer also sends malformed ones, which must be rejected) and
valid messages dropped (sent by agents minus accepted by fleetd minus telemetry samples fleetd's
inbox superseded with a newer one from the same node: those are counted apart, as
``superseded``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_stack import Sampler, Stack  # noqa: E402

HERE = Path(__file__).resolve().parent
FLEET = "load"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 4)


def _summed(usage: dict[str, dict[str, float]], field: str) -> float | None:
    parts = [usage[n][field] for n in ("fleetd", "fleetd_lister") if n in usage]
    return round(sum(parts), 1) if "fleetd" in usage else None


def wait_for(what: str, cond, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: process exited {proc.returncode}")
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def json_lines(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("fleetd_intake_messages_total{"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def run(a: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fleetd-agents-load-"))
    stack = Stack(work, FLEET)
    load_start = os.getloadavg()
    t_start = time.monotonic()
    try:
        stack.start_cloud(niceness=a.harness_nice)
        t = time.monotonic()
        ids = stack.create_instances(a.agents)
        create_s = time.monotonic() - t
        stack.start_broker(tls=not a.plain)
        pki = ["--pki", str(stack.pki.files.directory)] if stack.pki is not None else []
        stack.write_config(a.agents, a.interval)
        stack.start_fleetd()
        fleetd = stack.procs["fleetd"]

        def adopted() -> bool:
            return any(
                e.get("event") == "pass_done" and e.get("nodes", 0) >= a.agents
                for e in json_lines(stack.log_lines("fleetd"))
            )

        wait_for("fleetd's first pass over every instance", adopted, a.startup_timeout, fleetd)
        # Agents: one line "instance-id node-addr" each, split over the worker processes.
        procs = a.procs or max(1, math.ceil(a.agents / 500))
        workers = []
        observer_out = work / "observer.json"
        obs = stack.spawn(
            "observer",
            [
                sys.executable,
                str(HERE / "load_agents.py"),
                "--observe",
                "--broker",
                stack.broker,
                "--fleet",
                FLEET,
                "--out",
                str(observer_out),
                "--bad-rate",
                str(a.bad_rate),
                *pki,
            ],
        )
        wait_for("observer", lambda: Path(str(observer_out) + ".ready").exists(), 60, obs)
        connect_spread = max(5.0, a.agents / 100)
        agents_started = time.monotonic()
        for w in range(procs):
            mine = ids[w::procs]
            idf = work / f"ids-{w}.txt"
            idf.write_text(
                "".join(
                    f"{iid} 10.{(k >> 16) & 255}.{(k >> 8) & 255}.{k & 255}\n"
                    for k, iid in enumerate(mine, start=w * 100000)
                )
            )
            workers.append(
                stack.spawn(
                    f"agents-{w}",
                    [
                        sys.executable,
                        str(HERE / "load_agents.py"),
                        "--broker",
                        stack.broker,
                        "--fleet",
                        FLEET,
                        "--ids",
                        str(idf),
                        "--out",
                        str(work / f"agents-{w}.json"),
                        "--notice-rate",
                        str(a.notice_rate / procs),
                        "--notice-delay-s",
                        str(connect_spread + a.warmup),
                        "--connect-spread-s",
                        str(connect_spread),
                        "--seed",
                        str(w + 1),
                        *pki,
                    ],
                    niceness=a.harness_nice,
                )
            )
        time.sleep(connect_spread)
        time.sleep(a.warmup)
        # The measured window: notices flowing, every agent reporting.
        window_t0 = time.time()
        # fleetd's EC2 listing process (fleetd/adapters/ec2_list_process.py) counts as fleetd.
        listers = [c.pid for c in psutil.Process(fleetd.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        sampler = Sampler(
            {
                "fleetd": fleetd.pid,
                "mosquitto": stack.procs["mosquitto"].pid,
                "moto": stack.procs["moto"].pid,
                **({"fleetd_lister": listers[0]} if listers else {}),
            }
        )
        end = time.monotonic() + a.duration
        while time.monotonic() < end:
            if fleetd.poll() is not None:
                raise SystemExit(f"fleetd exited {fleetd.returncode} during the run; see {work}/fleetd.log")
            sampler.sample()
            time.sleep(1.0)
        usage = sampler.result()
        window_t1 = time.time()
        load_end = os.getloadavg()
        # Each agent connects at a random moment of the spread: on average half of it later.
        agents_active_s = time.monotonic() - agents_started - connect_spread / 2
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(60)
        time.sleep(3.0)  # the last telemetry reaches fleetd
        intake = scrape(stack.metrics_port)
        obs.send_signal(signal.SIGTERM)
        obs.wait(30)
    finally:
        stack.close()

    counts: dict[str, int] = {}
    for w in range(procs):
        for k, v in json.loads((work / f"agents-{w}.json").read_text()).items():
            counts[k] = counts.get(k, 0) + v
    seen = json.loads(observer_out.read_text())
    lat = [seen["drain"][i] - t for i, t in seen["notice"].items() if i in seen["drain"]]
    events = json_lines(stack.log_lines("fleetd"))
    in_window = [e for e in events if e.get("event") == "pass_done" and window_t0 <= _ts(e) <= window_t1]
    passes = [e["seconds"] for e in in_window]
    # fleetd's own share of a pass: its time minus what it awaited EC2 (moto here) for.
    own = [e["seconds"] - (e.get("ec2_s") or 0.0) for e in in_window]
    accepted = {
        ch: int(sum(v for k, v in intake.items() if f'channel="{ch}"' in k and 'result="accepted"' in k))
        for ch in ("status", "telemetry", "events")
    }
    rejected = int(sum(v for k, v in intake.items() if 'result="rejected"' in k))
    # Telemetry samples replaced in fleetd's inbox by a newer one from the same node before they
    # were read (fleetd/intake/coalesce.py): delivered and deliberately not applied, not lost.
    superseded = int(sum(v for k, v in intake.items() if 'result="superseded"' in k))
    # Every valid message an agent handed to its client (a publish that timed out on the agent's
    # side may still have been delivered, so attempts, not acknowledgements, are the baseline).
    sent = {ch: counts.get(f"{ch}_attempted", 0) for ch in ("status", "telemetry", "events")}
    sys_stats = seen.get("sys", {})
    broker_log = work / "mosquitto.mlog"
    result = {
        "tls": not a.plain,
        # A client whose session another connection with the same identity took over (the
        # controller once made two connections with its one certificate): must stay 0.
        "session_takeovers": (
            broker_log.read_text(errors="replace").count("already connected, closing old connection")
            if broker_log.exists()
            else None
        ),
        "agents": a.agents,
        "harness_nice": a.harness_nice,
        "agent_processes": procs,
        "duration_s": a.duration,
        "notice_rate_per_s": a.notice_rate,
        "notices": len(seen["notice"]),
        "drains": len(lat),
        "notices_without_drain": len(seen["notice"]) - len(lat),
        "notice_to_drain_p50_s": pct(lat, 0.5),
        "notice_to_drain_p99_s": pct(lat, 0.99),
        "notice_to_drain_max_s": pct(lat, 1.0),
        "reconcile_passes": len(passes),
        "reconcile_p50_s": pct(passes, 0.5),
        "reconcile_p99_s": pct(passes, 0.99),
        "reconcile_max_s": pct(passes, 1.0),
        "reconcile_own_p50_s": pct(own, 0.5),
        "reconcile_own_p99_s": pct(own, 0.99),
        "passes_with_ec2_calls": sum(1 for e in in_window if (e.get("ec2_s") or 0) > 0),
        "ec2_describe_s": _describe_times(events),
        # fleetd and its listing process together (the sum of their peaks: an upper bound).
        "controller_cpu_pct": _summed(usage, "cpu_pct"),
        "controller_peak_rss_mib": _summed(usage, "peak_rss_mib"),
        "lister_cpu_pct": usage.get("fleetd_lister", {}).get("cpu_pct"),
        "lister_peak_rss_mib": usage.get("fleetd_lister", {}).get("peak_rss_mib"),
        "broker_cpu_pct": usage.get("mosquitto", {}).get("cpu_pct"),
        "broker_peak_rss_mib": usage.get("mosquitto", {}).get("peak_rss_mib"),
        "moto_cpu_pct": usage.get("moto", {}).get("cpu_pct"),
        "sent": sent,
        # The offered load: 1.0 when every agent sent telemetry at 1 Hz (the low-priority agent
        # processes kept up); lower means fleetd was tested with less than the load asked for.
        "telemetry_hz_per_agent": round(sent["telemetry"] / a.agents / max(agents_active_s, 1e-9), 3),
        "accepted": accepted,
        "superseded": superseded,
        "dropped_valid": sum(sent.values()) - sum(accepted.values()) - superseded,
        "rejected": rejected,
        "malformed_sent": seen.get("bad_sent", 0),
        "agent_publish_errors": counts.get("publish_errors", 0),
        "agent_connect_errors": counts.get("connect_errors", 0),
        "agents_connected": counts.get("connected", 0),
        "broker_dropped": sys_stats.get("$SYS/broker/publish/messages/dropped"),
        "create_instances_s": round(create_s, 1),
        "total_s": round(time.monotonic() - t_start, 1),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "workdir": str(work),
    }
    return result


def _ts(e: dict) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(e.get("timestamp", "")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _describe_times(events: list[dict]) -> dict | None:
    """DescribeInstances as the EC2 view's refresher saw it (moto: grows with the fleet)."""
    xs = [e["seconds"] for e in events if e.get("event") == "ec2_listed"]
    return {"n": len(xs), "p50": pct(xs, 0.5), "max": pct(xs, 1.0)} if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=500)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of notices (the measured window)")
    ap.add_argument("--notice-rate", type=float, default=0.5, help="notices per second, fleet-wide")
    ap.add_argument("--bad-rate", type=float, default=0.5, help="malformed messages per second (must be rejected)")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="plaintext, anonymous MQTT (default: TLS with a certificate per client and the fleet ACL, as deployed)",
    )
    ap.add_argument("--interval", type=float, default=10.0, help="fleet.reconcile_interval_s (production default)")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=0, help="agent processes (default one per 500 agents)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument(
        "--harness-nice",
        type=int,
        default=19,
        help="niceness added to moto and the agent processes, the stand-ins for AWS and 2,000 "
        "other machines, so they use the CPU fleetd and mosquitto leave (0: equal footing, "
        "as before 2026-11-26; the observer, which stamps the latencies, stays at 0)",
    )
    a = ap.parse_args()
    r = run(a)
    print(
        f"{r['agents']} agents, {r['notices']} notices: notice->drain p50 {r['notice_to_drain_p50_s']} s "
        f"p99 {r['notice_to_drain_p99_s']} s; reconcile p50 {r['reconcile_p50_s']} s p99 {r['reconcile_p99_s']} s; "
        f"fleetd {r['controller_cpu_pct']} % CPU, peak {r['controller_peak_rss_mib']} MiB; "
        f"broker {r['broker_cpu_pct']} % CPU; dropped {r['dropped_valid']}, superseded {r['superseded']}, rejected {r['rejected']} "
        f"(load {r['loadavg_start']} -> {r['loadavg_end']})"
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
