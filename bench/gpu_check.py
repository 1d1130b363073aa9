"""The agent's GPU paths on a real GPU: NVML telemetry, CUDA training, the CUDA salvage path.

Run on a machine with an NVIDIA GPU (``python bench/gpu_check.py``); on a machine without one
``--device cpu`` runs the same checks on the CPU path (CI runs that short version). Checks:

- ``nvml``: ``agent.node.telemetry.GpuProbe`` sampled while the GPU is idle and while a matrix
  product loop loads it: utilisation and memory must move with the load, and the sample must
  build the wire ``Telemetry`` message.
- ``salvage_kill`` / ``salvage_hang``: two ranks of the toy trainer on the device (gloo: one GPU
  cannot hold two NCCL ranks), a peer SIGKILLed (the survivor's collective fails) or SIGSTOPped
  then the survivor SIGTERMed (its collective hangs, the save runs on the watcher thread and
  copies the CUDA state on a side stream): the survivor's disk must hold the last completed step.
- ``torchrun_restart``: the toy under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``,
  one worker SIGKILLed: the job must resume at the salvaged step (0 steps lost) and finish.
- ``lightning_sigterm`` / ``hf_sigterm``: the Lightning and Hugging Face callbacks on the device,
  one rank under torchrun SIGTERMed at step 50: it saves the completed step, torchrun restarts it,
  it resumes there and finishes.
- ``job_workspace``: a user's job as a node runs it: the toy project packed, verified, unpacked,
  its virtualenv made and its setup run (agent/supervise/workspace.py), then ``torchrun_restart``
  with that virtualenv's python in the code folder, the output through the agent's pipe.
- ``nccl_resume`` (CUDA only): one rank with NCCL, run twice: the checkpointer's collectives
  (resume's all-reduce, save's barrier) under a NCCL-only process group, resuming where it stopped.

Last line: one JSON object with each check's numbers and ``ok``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOY = [sys.executable, "-m", "agent.examples.toy_job.train_toy"]
TOY_SIZE: list[str] = []  # --dim/--hidden for the toy (--model-mib): a state worth copying off the GPU


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written as we read
            continue
    return out


def _steps(events: Path, rank: int = 0) -> list[int]:
    return [e["step"] for e in _events(events) if e.get("ev") == "step" and e.get("rank") == rank]


def _wait(cond, timeout: float, what: str, procs: list[subprocess.Popen] = ()) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process ended while waiting for {what}")
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()


def _toy_env(work: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "FLEETD_EVENTS_FILE": str(work / "events.jsonl"),
        "FLEETD_CKPT_INTERVAL": "1000",
        **extra,
    }


# ---------------------------------------------------------------------- NVML
def check_nvml(device: str, load_s: float) -> dict[str, Any]:
    from agent.node.telemetry import GpuProbe, sample_telemetry
    from agent.node.trainer_channel import TrainerProgress

    probe = GpuProbe()
    try:
        if not probe.available:
            return {"ok": device == "cpu", "available": False}
        idle = probe.sample()
        load = subprocess.Popen([sys.executable, "-c", _MATMUL_LOOP, str(load_s)])
        under: list[Any] = []
        try:
            t0 = time.monotonic()
            while load.poll() is None and time.monotonic() - t0 < load_s + 60:
                t_sample = time.monotonic()
                under.append(probe.sample())
                sample_ms = (time.monotonic() - t_sample) * 1000
                time.sleep(0.25)
        finally:
            load.wait(timeout=120)
        busy = [g for s in under for g in s]
        msg = sample_telemetry("i-gpucheck", under[-1] if under else idle, TrainerProgress(step=1))
        util_max = max((g.util_pct for g in busy), default=0.0)
        mem_peak = max((g.mem_used_mib for g in busy), default=0.0)
        return {
            "ok": load.returncode == 0 and util_max >= 50 and mem_peak > idle[0].mem_used_mib + 1024,
            "available": True,
            "gpus": len(idle),
            "idle_util_pct": idle[0].util_pct,
            "idle_mem_used_mib": round(idle[0].mem_used_mib),
            "load_util_max_pct": util_max,
            "load_mem_peak_mib": round(mem_peak),
            "mem_total_mib": round(idle[0].mem_total_mib),
            "samples": len(under),
            "last_sample_ms": round(sample_ms, 2) if under else None,
            "telemetry_bytes": len(msg.model_dump_json()),
        }
    finally:
        probe.close()


# A second process loads the GPU (the agent's probe watches from outside, as on a node).
_MATMUL_LOOP = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # 4 GiB held: memory must show it
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


# ---------------------------------------------------------------------- salvage, two ranks
def _start_pair(work: Path, device: str) -> tuple[list[subprocess.Popen], Path]:
    from fleetd.localnet import free_port

    port = free_port()
    procs = []
    for rank in (0, 1):
        env = _toy_env(
            work,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="1",
            FLEETD_CKPT_DIR=str(work / f"node{rank}"),
            FLEETD_NODE_ADDR=f"node{rank}",
        )
        cmd = [*TOY, "--steps", "1000000", "--step-sleep", "0.02", "--device", device, "--backend", "gloo", *TOY_SIZE]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(work / f"rank{rank}.log", "w")
            )
        )
    return procs, work / "events.jsonl"


def check_salvage(device: str, how: str, work: Path) -> dict[str, Any]:
    from agent.trainer import local_ckpt

    procs, events = _start_pair(work, device)
    try:
        _wait(lambda: max(_steps(events), default=0) >= 30, 180, "step 30", procs)
        if how == "kill":
            procs[1].send_signal(signal.SIGKILL)  # its sockets close: rank 0's collective fails
            t0 = time.monotonic()
        else:
            procs[1].send_signal(signal.SIGSTOP)  # no FIN, no RST: rank 0 hangs in the collective
            time.sleep(2.0)
            hung_at = max(_steps(events))
            time.sleep(1.0)
            if max(_steps(events)) != hung_at:
                return {"ok": False, "why": "rank 0 kept stepping with its peer frozen"}
            t0 = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)  # what torchrun does once fleetd drops the silent rank
        procs[0].wait(timeout=60)
        exit_s = time.monotonic() - t0
        last = max(_steps(events))
        salvaged = [e for e in _events(events) if e.get("ev") == "salvaged"]
        newest = local_ckpt.newest_complete(work / "node0", "state_dict")
        state = local_ckpt.load_plain(work / "node0", newest) if newest is not None else {}
        on_host = all(not t.is_cuda for t in _tensors(state))
        start = next((e for e in _events(events) if e.get("ev") == "start" and e.get("rank") == 0), {})
        return {
            "ok": [e["step"] for e in salvaged] == [last]
            and newest == last
            and on_host
            and start.get("device", "cpu").startswith(device),
            "device": start.get("device"),
            "last_completed_step": last,
            "salvaged_step": salvaged[0]["step"] if salvaged else None,
            "salvage_s": salvaged[0]["duration_s"] if salvaged else None,
            "survivor_exit_s": round(exit_s, 2),
            "survivor_rc": procs[0].returncode,
            "saved_tensors_on_host": on_host,
        }
    finally:
        _stop(procs)


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ---------------------------------------------------------------------- torchrun, a worker lost
def check_torchrun_restart(
    device: str,
    work: Path,
    steps: int,
    module: str = "agent.examples.toy_job.train_toy",
    nproc: int = 2,
    victim: int = 1,
    sig: int = signal.SIGKILL,
    extra: tuple[str, ...] = ("--backend", "gloo"),
    python: str = sys.executable,
    cwd: Path = ROOT,
    env_extra: dict[str, str] | None = None,
    output: Any = None,
) -> dict[str, Any]:
    """The job under ``torchrun --max-restarts 3`` (the agent gives 100); rank ``victim``'s worker
    gets ``sig`` at step 50 (SIGKILL: a peer lost; SIGTERM: the worker stopped, as torchrun stops
    a hung one). A restart whose process group fails to form (gloo's connect gave up once on the
    H200 while the new peer was still starting CUDA) is retried, as torchrun does for the agent."""
    events = work / "events.jsonl"
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        "-m",
        module,
        "--steps",
        str(steps),
        "--step-sleep",
        "0.01",
        "--device",
        device,
        *extra,
    ]
    # As the agent launches torchrun (agent/supervise/launch.py): the workers get a fresh store
    # each round. With torchrun's default (the rendezvous store shared with the workers) a
    # restarted gloo group read the previous round's keys, dialled a dead address and in 2 of 6
    # CPU runs here hung past the bound; with a store per round 0 of 10 (2026-11-26).
    env = _toy_env(
        work, FLEETD_CKPT_DIR=str(work / "node"), FLEETD_NODE_ADDR="node0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )
    env.update(env_extra or {})
    if output is None:
        run = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=open(work / "torchrun.log", "w")
        )
    else:  # the agent's pipe (agent/supervise/worker_output.py): stdout and stderr, drained by a thread
        run = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=output.writer(), stderr=subprocess.STDOUT)
        output.close_writer()
    try:
        _wait(lambda: max(_steps(events), default=0) >= 50, 300, "step 50", [run])
        target = next(e["pid"] for e in _events(events) if e.get("ev") == "start" and e.get("rank") == victim)
        t_kill = time.time()
        os.kill(target, sig)
        run.wait(timeout=240)  # a restart that hangs (see test_gpu_check_bench.py) fails the check, bounded
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    evs = [e for e in _events(events) if e.get("rank") == 0]
    starts = [e for e in evs if e["ev"] == "start"]
    before = [e["step"] for e in evs if e["ev"] == "step" and e["t"] < (starts[-1]["t"] if len(starts) > 1 else 1e18)]
    after = [e["t"] for e in evs if e["ev"] == "step" and len(starts) > 1 and e["t"] > starts[-1]["t"]]
    salvaged = [e["step"] for e in evs if e["ev"] == "salvaged"]
    resumed = starts[-1]["from_step"] if len(starts) > 1 else None
    done = [e["step"] for e in evs if e["ev"] == "done"]
    # The salvage saves the step the parameters hold (salvage.UpdateGuard), which can be one past
    # the last step the worker reported: the signal came after an update and before its report
    # (the Lightning worker once saved and resumed 53 with 52 its last report; CI, 2026-11-28).
    # Nothing is lost or redone then; a resume from any other step is a loss or a skip.
    return {
        "ok": run.returncode == 0
        and done == [steps]
        and resumed is not None
        and salvaged == [resumed]
        and resumed - max(before) in (0, 1),
        "module": module,
        "device": starts[0].get("device", device) if starts else None,
        "returncode": run.returncode,
        "worker_failures": _failures(work / "torchrun.log"),  # the kill's, plus any restart that failed
        "last_step_before_restart": max(before, default=None),
        "salvaged_steps": salvaged,
        "resumed_from": resumed,
        "steps_lost": max(0, max(before) - resumed) if resumed is not None else None,
        "saved_past_last_report": resumed - max(before) if resumed is not None else None,
        "kill_to_next_step_s": round(after[0] - t_kill, 2) if after else None,
        "steps_per_s_after_restart": round((len(after) - 1) / (after[-1] - after[0]), 1) if len(after) > 10 else None,
        "done_step": done[0] if done else None,
    }


def _failures(log: Path) -> int | None:
    """How many worker groups torchrun saw fail (it logs each failure before restarting)."""
    try:
        return log.read_text(errors="replace").count("failed (exitcode")
    except OSError:
        return None


# ---------------------------------------------------------------------- NCCL, one rank twice
def check_nccl_resume(work: Path) -> dict[str, Any]:
    events = work / "events.jsonl"
    env = _toy_env(work, FLEETD_CKPT_DIR=str(work / "node"), FLEETD_NODE_ADDR="node0")
    runs = []
    for steps in (40, 80):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "agent.examples.toy_job.train_toy",
            "--steps",
            str(steps),
            "--step-sleep",
            "0",
            "--device",
            "cuda",
            "--backend",
            "nccl",
        ]
        with open(work / f"nccl{steps}.log", "w") as log:
            runs.append(subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, timeout=300))
    starts = [e for e in _events(events) if e.get("ev") == "start"]
    done = [e["step"] for e in _events(events) if e.get("ev") == "done"]
    return {
        "ok": [r.returncode for r in runs] == [0, 0]
        and [s.get("from_step") for s in starts] == [0, 40]
        and done == [40, 80]
        and all(s.get("backend") == "nccl" for s in starts),
        "returncodes": [r.returncode for r in runs],
        "backend": [s.get("backend") for s in starts],
        "from_steps": [s.get("from_step") for s in starts],
        "done_steps": done,
        "log_tail": "" if runs[-1].returncode == 0 else (work / "nccl80.log").read_text()[-600:],
    }


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    from gpu_job_check import check_job_workspace  # bench/: the script's own folder is on sys.path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--load-s", type=float, default=6.0, help="seconds of GPU load for the NVML check")
    p.add_argument("--steps", type=int, default=300, help="steps of the torchrun job")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--only", action="append", default=None, help="run only this check (repeatable)")
    p.add_argument(
        "--model-mib",
        type=int,
        default=0,
        help="salvage checks: size the toy's parameters to about this many MiB (0: the tiny toy)",
    )
    args = p.parse_args(argv)
    if args.model_mib:
        # Two dim x hidden layers of fp32: 8 * dim * hidden bytes of parameters (momentum doubles it).
        hidden = max(64, args.model_mib * 2**20 // (8 * 1024))
        TOY_SIZE[:] = ["--dim", "1024", "--hidden", str(hidden)]
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fleetd-gpu-check-"))
    result: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "toy_size": TOY_SIZE,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
    }
    checks = {
        "nvml": lambda d: check_nvml(device, args.load_s),
        "salvage_kill": lambda d: check_salvage(device, "kill", d),
        "salvage_hang": lambda d: check_salvage(device, "hang", d),
        "torchrun_restart": lambda d: check_torchrun_restart(device, d, args.steps),
        # The framework callbacks on the device: one rank, stopped with SIGTERM mid-run (fleetd's
        # watcher replaces Lightning's handler and saves the completed step), restarted by torchrun.
        "lightning_sigterm": lambda d: check_torchrun_restart(
            device, d, 150, "agent.examples.train_lightning", nproc=1, victim=0, sig=signal.SIGTERM, extra=()
        ),
        "hf_sigterm": lambda d: check_torchrun_restart(
            device, d, 150, "agent.examples.train_hf", nproc=1, victim=0, sig=signal.SIGTERM, extra=()
        ),
        "job_workspace": lambda d: check_job_workspace(device, d, args.steps, check_torchrun_restart),
    }
    if device == "cuda":
        checks["nccl_resume"] = check_nccl_resume
    checks = {n: c for n, c in checks.items() if args.only is None or n in args.only}
    for name, check in checks.items():
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            result[name] = check(d)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' numbers
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        result[name]["took_s"] = round(time.monotonic() - t0, 1)
        print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["ok"] = all(result[n]["ok"] for n in checks)
    result["work_dir"] = str(work)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
