"""A whole elastic job on one machine: the rendezvous host and fleetd's steering loop as separate
processes, and "nodes" that are torchruns on distinct loopback addresses (127.0.0.2, .3, ... all
reach this host on Linux). Used by the tests, bench/rebalance.py and the demo.

Every process is started in its own session and every one is killed on ``close()`` (its whole
tree), so nothing outlives the cluster. The nodes' training ranks append JSON lines to one events
file; :class:`Events` reads them to measure world sizes, steps and timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.supervise.launch import WARM_PRELOAD, LaunchSpec
from agent.supervise.proctree import kill_tree, process_tree
from agent.supervise.torchrun import TorchrunProcess
from fleetd.localnet import free_port, wait_port


@dataclass
class Events:
    path: Path

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
        return out

    def of(self, ev: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]

    def last_step(self, **match: Any) -> int:
        steps = [e["step"] for e in self.of("step", **match)]
        return max(steps) if steps else 0

    def training_at(self, world: int, since: float, nodes: set[str] | None = None) -> dict[int, float]:
        """rank -> time of its first completed step at ``world`` after ``since``."""
        first: dict[int, float] = {}
        for e in self.read():
            if e["ev"] == "step" and e["world"] == world and e["t"] >= since:
                if nodes is None or e["node"] in nodes:
                    first.setdefault(e["rank"], e["t"])
        return first

    def wait_training(self, world: int, since: float, timeout: float, nodes: set[str] | None = None) -> float:
        """Wait until every rank of a ``world``-sized job completed a step after ``since``;
        return the time the last of them did."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            first = self.training_at(world, since, nodes)
            if len(first) >= world:
                return max(first.values())
            time.sleep(0.05)
        raise TimeoutError(
            f"not all {world} ranks trained at world {world} within {timeout}s: {self.training_at(world, since, nodes)}"
        )


@dataclass
class LocalCluster:
    workdir: Path
    run_id: str = "job"
    min_nodes: int = 1
    max_nodes: int = 8
    train_args: tuple[str, ...] = ("--steps", "100000")
    entrypoint: str = "agent.examples.toy_job.train_toy"
    ckpt_interval: int = 0
    steered: bool = True  # False: plain torchrun defaults (the comparison baseline)
    s3_bucket: str | None = None
    s3_endpoint: str | None = None
    s3_prefix: str = "checkpoints"
    extra_env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()  # more modules for the warm pool (a framework's, e.g. "transformers")
    host: str = "127.0.0.1"
    port: int = 0
    rdzv_host_proc: subprocess.Popen[bytes] | None = None
    steering_proc: subprocess.Popen[bytes] | None = None
    nodes: dict[str, TorchrunProcess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        self.events = Events(self.workdir / "events.jsonl")

    # ------------------------------------------------------------------ processes
    def _spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out = open(self.workdir / log_name, "ab")  # noqa: SIM115
        try:
            return subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        finally:
            out.close()

    def start_host(self) -> None:
        cfg = self.workdir / "fleetd.toml"
        cfg.write_text(
            f'[rendezvous]\nhost = "{self.host}"\nport = {self.port}\nrun_id = "{self.run_id}"\n'
            "[logging]\njson = true\n"
        )
        self.rdzv_host_proc = self._spawn(
            [sys.executable, "-m", "fleetd.cli", "rendezvous", "--config", str(cfg)], "rendezvous-host.log"
        )
        until = time.monotonic() + 90  # imports torch: slow on a busy 2-core machine
        while True:
            try:
                wait_port(self.host, self.port, timeout=0.5)
                return
            except TimeoutError:
                log = (self.workdir / "rendezvous-host.log").read_text()[-2000:]
                if self.rdzv_host_proc.poll() is not None:
                    raise RuntimeError(f"rendezvous host exited ({self.rdzv_host_proc.returncode}): {log}") from None
                if time.monotonic() > until:
                    raise TimeoutError(f"rendezvous host not listening on {self.host}:{self.port}: {log}") from None

    def start_steering(self) -> None:
        self.steering_proc = self._spawn(
            [
                sys.executable,
                "-m",
                "fleetd.rendezvous.steer_main",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--run-id",
                self.run_id,
                "--min-nodes",
                str(self.min_nodes),
                "--max-nodes",
                str(self.max_nodes),
                "--dead-after-s",
                "3",
            ],
            "steering.log",
        )

    def kill_steering(self) -> None:
        if self.steering_proc is not None:
            self.steering_proc.send_signal(signal.SIGKILL)
            self.steering_proc.wait()
            self.steering_proc = None

    def spec(self, addr: str) -> LaunchSpec:
        common: dict[str, Any] = dict(
            entrypoint=self.entrypoint,
            args=self.train_args,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            rdzv_host=self.host,
            rdzv_port=self.port,
            run_id=self.run_id,
            node_addr=addr,
            ckpt_dir=self.workdir / "nodes" / addr / "checkpoints",
            ckpt_interval=self.ckpt_interval,
            s3_bucket=self.s3_bucket,
            s3_endpoint=self.s3_endpoint,
            s3_prefix=self.s3_prefix,
            job=self.run_id,
            extra_env=tuple({"FLEETD_EVENTS_FILE": str(self.events.path), **self.extra_env}.items()),
            warm_preload=WARM_PRELOAD + self.preload,
        )
        if not self.steered:
            # torchrun as people run it: default timeouts and polling, no fleetd steering.
            # (max_restarts stays high: with torchrun's default of 0 a lost peer ends the job.)
            common.update(
                last_call_timeout_s=30,
                keep_alive_s=5,
                keep_alive_max_attempt=3,
                close_timeout_s=30,
                rdzv_poll_s=None,
                warm_pool=False,
            )
        return LaunchSpec(**common)

    def add_node(self, addr: str) -> TorchrunProcess:
        proc = TorchrunProcess(self.spec(addr), log_path=self.workdir / "nodes" / addr / "torchrun.log").start()
        self.nodes[addr] = proc
        return proc

    def kill_node(self, addr: str) -> None:
        """Lose a node without notice: SIGKILL its whole tree."""
        proc = self.nodes.pop(addr)
        proc.kill()
        proc.wait_blocking()

    def freeze_node(self, addr: str) -> None:
        """Lose a node silently: SIGSTOP its whole tree. Its sockets stay open and say nothing,
        as when a machine vanishes without a notice (no FIN, no RST): peers hang, not fail.
        ``close`` (or ``kill_node``) still ends it."""
        self.nodes[addr].freeze()

    def close(self) -> None:
        for addr in list(self.nodes):
            proc = self.nodes.pop(addr)
            proc.kill()
            if proc.proc is not None:
                proc.wait_blocking()
        for p in (self.steering_proc, self.rdzv_host_proc):
            if p is not None and p.poll() is None:
                kill_tree(process_tree(p.pid), signal.SIGKILL)
                p.wait()
        self.steering_proc = self.rdzv_host_proc = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def logs(self) -> str:
        parts = []
        for p in sorted(self.workdir.rglob("*.log")):
            parts.append(f"===== {p.relative_to(self.workdir)}\n{p.read_text()[-3000:]}")
        return "\n".join(parts)
