"""The processes bench/agents_load.py measures: moto server (as its own process) holding the
fleet's instances, the fault proxy in front of it answering the price APIs, a real mosquitto
configured as production's (deploy/mosquitto/mosquitto.conf: TLS with a certificate per client
from the fleet CA, the fleet ACL, max_queued_messages 10000; `--plain` for plaintext, to compare),
`fleetd rendezvous` and `fleetd run` as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import psutil

from fleetd.adapters.catalog import bundled_catalog
from fleetd.adapters.ec2 import TAG_FLEET, TAG_JOB
from fleetd.adapters.faults import FaultProxy
from fleetd.adapters.pricing_fake import PriceListFake, SpotPriceFake
from fleetd.demo.broker import find_mosquitto, mosquitto_config
from fleetd.demo.security import DemoPki
from fleetd.identity.acl import FLEET_ACL
from fleetd.identity.ca import CONTROLLER_CN
from fleetd.localnet import free_port, wait_port
from fleetd.policy.model import PoolId

ZONES = ("us-east-1a", "us-east-1b")
TYPES = ("g5.xlarge", "g4dn.xlarge")
SPOT = {
    PoolId("g4dn.xlarge", "us-east-1a"): 0.2206,
    PoolId("g4dn.xlarge", "us-east-1b"): 0.2341,
    PoolId("g5.xlarge", "us-east-1a"): 0.4121,
    PoolId("g5.xlarge", "us-east-1b"): 0.3987,
}
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def env() -> dict[str, str]:
    e = {**os.environ, **FAKE_AWS, "PYTHONUNBUFFERED": "1"}
    e.pop("AWS_PROFILE", None)
    return e


class Stack:
    def __init__(self, workdir: Path, fleet: str):
        os.environ.update(FAKE_AWS)
        self.dir = workdir
        self.fleet = fleet
        self.procs: dict[str, subprocess.Popen] = {}
        self.proxy: FaultProxy | None = None

    def spawn(self, name: str, argv: list[str], *, niceness: int = 0, **kw) -> subprocess.Popen:
        """``niceness``: added to this process's; the harness's stand-ins for other machines (the
        cloud, the agents) run at a low priority so that they take the CPU the control host's own
        processes (fleetd, its broker) leave, as they would from their own machines."""
        out = (self.dir / f"{name}.log").open("w")
        if niceness:
            kw["preexec_fn"] = lambda: os.nice(niceness)
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env(), **kw)
        self.procs[name] = p
        return p

    def start_cloud(self, niceness: int = 0) -> None:
        port = free_port()
        self.spawn("moto", [sys.executable, "-m", "moto.server", "-p", str(port)], niceness=niceness)
        wait_port("127.0.0.1", port, 60)
        self.moto = f"http://127.0.0.1:{port}"
        self.ec2 = boto3.client("ec2", endpoint_url=self.moto, region_name="us-east-1")
        subnets = self.ec2.describe_subnets()["Subnets"]
        self.subnets = {s["AvailabilityZone"]: s["SubnetId"] for s in subnets if s.get("DefaultForAz")}
        named = {"Name": "name", "Values": ["amzn2-ami-hvm-2.0*"]}
        self.ami = self.ec2.describe_images(Owners=["amazon"], Filters=[named])["Images"][0]["ImageId"]
        catalog = bundled_catalog()
        spot = SpotPriceFake(catalog)
        for pool, price in SPOT.items():
            spot.set(pool, price)
        self.proxy = FaultProxy(
            self.moto, {v: k for k, v in self.subnets.items()}, price_list=PriceListFake(catalog), spot_prices=spot
        ).start()

    def create_instances(self, n: int) -> list[str]:
        """N running spot instances tagged as the fleet's, spread over the four pools."""
        ids: list[str] = []
        pools = [(t, z) for t in TYPES for z in ZONES]
        for k, (itype, zone) in enumerate(pools):
            share = n // len(pools) + (1 if k < n % len(pools) else 0)
            while share > 0:
                batch = min(share, 500)
                resp = self.ec2.run_instances(
                    ImageId=self.ami,
                    MinCount=batch,
                    MaxCount=batch,
                    InstanceType=itype,
                    SubnetId=self.subnets[zone],
                    InstanceMarketOptions={"MarketType": "spot"},
                    TagSpecifications=[
                        {
                            "ResourceType": "instance",
                            "Tags": [{"Key": TAG_FLEET, "Value": self.fleet}, {"Key": TAG_JOB, "Value": "train"}],
                        }
                    ],
                )
                ids += [i["InstanceId"] for i in resp["Instances"]]
                share -= batch
        return ids

    def start_broker(self, tls: bool = True) -> str:
        """The broker as production runs it (``tls``): TLS with client certificates from the fleet
        CA and the fleet ACL; or plaintext and anonymous, to compare."""
        port = free_port()
        conf = self.dir / "mosquitto.conf"
        self.pki: DemoPki | None = None
        acl = None
        if tls:
            self.pki = DemoPki.create(self.dir)
            acl = self.dir / "acl"
            # The bench's observer also reads the broker's own counters ($SYS), outside the fleet's.
            acl.write_text(FLEET_ACL + "\nuser fleetd-observer\ntopic read $SYS/#\n")
        conf.write_text(
            mosquitto_config(port, self.dir / "mosquitto.mlog", pki=self.pki, acl=acl)
            + "max_queued_messages 10000\nsys_interval 5\nlog_type notice\n"
        )
        exe = find_mosquitto()
        if exe is None:
            raise SystemExit("mosquitto is not installed (apt-get install -y mosquitto)")
        self.spawn("mosquitto", [exe, "-c", str(conf)])
        wait_port("127.0.0.1", port, 20)
        self.broker = f"127.0.0.1:{port}"
        return self.broker

    def mqtt_toml(self) -> str:
        if self.pki is None:
            return f'[mqtt]\nurl = "mqtt://{self.broker}"\n'
        crt, key = self.pki.files.client(CONTROLLER_CN)
        return (
            f'[mqtt]\nurl = "mqtts://{self.broker}"\nca_file = "{self.pki.files.ca_cert}"\n'
            f'cert_file = "{crt}"\nkey_file = "{key}"\n'
        )

    def write_config(self, nodes: int, interval_s: float) -> Path:
        q = lambda xs: ", ".join(f'"{x}"' for x in xs)  # noqa: E731
        self.metrics_port = free_port()
        self.rdzv_port = free_port()
        self.state_dir = self.dir / "state"
        path = self.dir / "fleetd.toml"
        path.write_text(
            f'[aws]\nendpoint_url = "{self.proxy.url}"\n'
            f'[fleet]\nname = "{self.fleet}"\nmin_nodes = {nodes}\nmax_nodes = {nodes}\n'
            f'state_dir = "{self.state_dir}"\nreconcile_interval_s = {interval_s}\n'
            f"[capacity]\ninstance_types = [{q(TYPES)}]\nzones = [{q(ZONES)}]\n"
            f'ami_id = "{self.ami}"\nsubnet_ids = [{q(self.subnets[z] for z in ZONES)}]\n'
            "[budget]\ntotal_usd = 100000000.0\nmax_usd_per_hour = 1000000.0\n"
            + self.mqtt_toml()
            + f"[rendezvous]\nport = {self.rdzv_port}\n"
            f"[metrics]\nport = {self.metrics_port}\n[logging]\njson = true\n"
        )
        self.config = path
        return path

    def start_fleetd(self) -> None:
        cli = [sys.executable, "-m", "fleetd.cli"]
        self.spawn("rendezvous", [*cli, "rendezvous", "--config", str(self.config)])
        wait_port("127.0.0.1", self.rdzv_port, 120)
        self.spawn("fleetd", [*cli, "run", "--config", str(self.config)])

    def log_lines(self, name: str) -> list[str]:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def stop(self, name: str, timeout: float = 30.0) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name, 15.0)
        if self.proxy is not None:
            self.proxy.stop()


class Sampler:
    """CPU seconds and peak RSS of named processes over a window (psutil; VmHWM for the peak)."""

    def __init__(self, pids: dict[str, int]):
        self.procs = {n: psutil.Process(p) for n, p in pids.items()}
        self.start_cpu = {n: self._cpu(p) for n, p in self.procs.items()}
        self.t0 = time.monotonic()
        self.peak_rss = {n: 0 for n in self.procs}

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    def sample(self) -> None:
        for n, p in self.procs.items():
            try:
                self.peak_rss[n] = max(self.peak_rss[n], p.memory_info().rss)
            except psutil.Error:
                pass

    def result(self) -> dict[str, dict[str, float]]:
        wall = time.monotonic() - self.t0
        out = {}
        for n, p in self.procs.items():
            try:
                cpu = self._cpu(p) - self.start_cpu[n]
                hwm = _vm_hwm(p.pid)
            except psutil.Error:
                continue
            out[n] = {
                "cpu_pct": round(100 * cpu / wall, 1),
                "peak_rss_mib": round(max(hwm, self.peak_rss[n]) / 2**20, 1),
            }
        return out


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
