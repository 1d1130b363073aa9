"""Real network faults for tests: cut one node from the broker, the store, or both, for a set time.

How: packet filtering (iptables, DROP: a blackhole, as when a link or a security group goes away;
no RST, so both ends find out only through their own timeouts) inside a *private* network
namespace (``unshare -n``), so the rules can never touch this shared machine's own network.

Why destination aliases: on loopback every connection carries the source address 127.0.0.1
whatever the node's own address, so packets cannot be told apart by source. Instead each node
reaches the control host through an address of its own, ``control_alias(node_addr)`` (node
127.0.0.N -> 127.1.0.N; all of 127/8 is the local host), and a cut drops that alias's traffic
to (and from) the broker's or the store's port. Node-to-node traffic (gloo collectives, the
workers' own store on the rank-0 node) uses the nodes' own addresses and is never cut.

    with in_private_netns():  # only meaningful in a process started by run_in_private_netns
        faults = NetFaults()
        with faults.cut(control_alias("127.0.0.11"), [broker_port]):
            ...                   # the node's MQTT packets are dropped here
        await faults.cut_for(alias, [store_port], seconds=3.0)

tc (iproute2) would do but its drop action is a kernel module this container cannot load;
iptables (installed by scripts/setup.sh) works with the built-in ip_tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

COMMENT = "fleetd-netfault"


def control_alias(node_addr: str) -> str:
    """The address node ``node_addr`` (127.0.0.N) uses to reach the control host: 127.1.0.N."""
    parts = node_addr.split(".")
    if len(parts) != 4 or parts[:3] != ["127", "0", "0"]:
        raise ValueError(f"{node_addr!r} is not a local node address 127.0.0.N")
    return f"127.1.0.{parts[3]}"


PARENT_NS_ENV = "FLEETD_NETFAULT_PARENT_NETNS"


def _netns() -> str:
    return os.readlink("/proc/self/ns/net")


def private_netns_argv(argv: list[str]) -> list[str]:
    """``argv`` run in a fresh network namespace with its loopback up (root or CAP_SYS_ADMIN)."""
    return ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "netns", *argv]


def private_netns_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``private_netns_argv``: names the namespace it leaves behind, so the
    child can prove it is somewhere else before it touches a firewall rule."""
    return {**(os.environ if base is None else base), PARENT_NS_ENV: _netns()}


def run_in_private_netns(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs["env"] = private_netns_env(kwargs.get("env"))
    return subprocess.run(private_netns_argv(argv), **kwargs)


def in_private_netns() -> bool:
    """True in a process started by run_in_private_netns (its namespace is not its parent's)."""
    parent = os.environ.get(PARENT_NS_ENV)
    try:
        return bool(parent) and _netns() != parent
    except OSError:
        return False


def find_iptables() -> str:
    exe = shutil.which("iptables") or shutil.which("iptables-legacy")
    if exe is None:
        raise RuntimeError("iptables is not installed: run scripts/setup.sh or `apt-get install -y iptables`")
    return exe


@dataclass(frozen=True)
class Cut:
    alias: str
    ports: tuple[int, ...]

    def rules(self) -> list[list[str]]:
        out = []
        for port in self.ports:
            # Both directions: the node's packets to the service, and the service's to the node.
            out.append(["OUTPUT", "-d", self.alias, "-p", "tcp", "--dport", str(port)])
            out.append(["OUTPUT", "-s", self.alias, "-p", "tcp", "--sport", str(port)])
        return out


class NetFaults:
    """Adds and removes DROP rules; refuses to run outside a private network namespace."""

    def __init__(self) -> None:
        if not in_private_netns():
            raise RuntimeError("NetFaults only runs in a private network namespace (run_in_private_netns)")
        self.exe = find_iptables()
        self.active: list[Cut] = []
        self._dropped_healed = 0  # counted from rules already removed

    def _iptables(self, op: str, rule: list[str]) -> None:
        chain, *match = rule
        subprocess.run(
            [self.exe, "-w", op, chain, *match, "-m", "comment", "--comment", COMMENT, "-j", "DROP"],
            check=True,
            capture_output=True,
        )

    def start(self, alias: str, ports: Iterable[int]) -> Cut:
        cut = Cut(alias, tuple(ports))
        for rule in cut.rules():
            self._iptables("-A", rule)
        self.active.append(cut)
        return cut

    def heal(self, cut: Cut) -> None:
        self._dropped_healed += self._counted(cut)
        for rule in cut.rules():
            self._iptables("-D", rule)
        self.active.remove(cut)

    def heal_all(self) -> None:
        for cut in list(self.active):
            self.heal(cut)

    @contextlib.contextmanager
    def cut(self, alias: str, ports: Iterable[int]) -> Iterator[Cut]:
        c = self.start(alias, ports)
        try:
            yield c
        finally:
            self.heal(c)

    async def cut_for(self, alias: str, ports: Iterable[int], seconds: float) -> Cut:
        """Cut, wait ``seconds``, heal (healed also when cancelled)."""
        with self.cut(alias, ports) as c:
            await asyncio.sleep(seconds)
        return c

    def _counted(self, cut: Cut | None = None) -> int:
        out = subprocess.run(
            [self.exe, "-w", "-L", "OUTPUT", "-v", "-n", "-x"], check=True, capture_output=True, text=True
        ).stdout
        total = 0
        for line in out.splitlines():
            if COMMENT in line and (cut is None or cut.alias in line.split()):
                total += int(line.split()[0])
        return total

    def dropped_packets(self) -> int:
        """Packets our rules dropped so far, healed cuts included: proof that a cut cut something."""
        return self._dropped_healed + self._counted()
