"""Does fleetd declare a healthy node lost when the box is starved? (loss.silent_after_s)

Runs the demo's calm scenario (3 nodes, no interruption at all: every node stays healthy) for
``--minutes`` beside ``--burners`` CPU burners (busy loops at nice 0, as other work on the host),
then reads the run's logs:

- removals: the steering's RemoveNodes for a member silent on both channels, or for a stale
  heartbeat; in this run every one of them is a false positive;
- re-forms: rounds completed after the first one (a false loss, or anything else that re-formed);
- peak quiet: the longest a member stayed quiet on both the store and the broker while still
  counted alive (the `rendezvous_quiet_peak` log lines): the margin under silent_after_s;
- tolerated: members with a stale heartbeat kept because the job advanced (TolerateStale).

    .venv/bin/python bench/false_loss.py [--minutes 5] [--burners 2]    # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetd.config import LossConfig  # noqa: E402


def _burner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict):
            out.append(e)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="training time, after set-up")
    p.add_argument("--burners", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleetd-bench-false-loss-"))
    burners = [_burner() for _ in range(args.burners)]
    started = time.monotonic()
    loads: list[float] = []
    try:
        demo = subprocess.Popen(
            [
                str(ROOT / ".venv/bin/fleetd"),
                "demo",
                "--scenario",
                "calm",
                "--duration",
                str(args.minutes * 60),
                "--report",
                str(work / "report.json"),
                "--workdir",
                str(work / "run"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while demo.poll() is None:
            loads.append(os.getloadavg()[0])
            time.sleep(10)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    events = _events(work / "run" / "fleetd.log")
    steers = [e for e in events if e.get("event") == "rendezvous_steer"]
    # A drained node's removal is the demo ending the job, not a loss.
    removals = [
        str(e.get("reason"))
        for e in steers
        if e.get("action") == "RemoveNodes" and "draining" not in str(e.get("reason"))
    ]
    rounds = [e for e in steers if e.get("action") == "CompleteRound"]
    peaks = [float(str(e["quiet_s"])) for e in events if e.get("event") == "rendezvous_quiet_peak"]
    report = json.loads((work / "report.json").read_text()) if (work / "report.json").exists() else {}
    result = {
        "minutes": args.minutes,
        "burners": args.burners,
        "demo_exit": demo.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "load_average_max": round(max(loads, default=0.0), 2),
        "load_average_median": round(sorted(loads)[len(loads) // 2], 2) if loads else None,
        "final_step": report.get("final_step"),
        "false_removals": len(removals),
        "removal_reasons": removals,
        "re_forms": max(0, len(rounds) - 1),
        "tolerated_stale": sum(1 for e in steers if e.get("action") == "TolerateStale"),
        # Logged only from half of silent_after_s up: None means it stayed below that.
        "peak_quiet_s": max(peaks, default=None),
        "peak_quiet_below_s": None if peaks else LossConfig().silent_after_s / 2,
        "workdir": str(work),
    }
    print(f"calm run of {args.minutes:g} min beside {args.burners} burners: {len(removals)} false removals")
    print(json.dumps(result))
    return 0 if demo.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
