"""The network fault helper cuts real TCP connections (tests/harness/netfault.py), and only in a
private network namespace."""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness.netfault import NetFaults, control_alias, in_private_netns, run_in_private_netns

# Runs inside the private namespace: an established connection and new ones through one node's
# alias, cut and healed, while another node's alias stays open the whole time.
CHECK = r"""
import json, socket, threading
from tests.harness.netfault import NetFaults, control_alias

srv = socket.socket(); srv.bind(("0.0.0.0", 0)); srv.listen(16)
port = srv.getsockname()[1]
peers = []
threading.Thread(target=lambda: [peers.append(srv.accept()[0]) for _ in iter(int, 1)], daemon=True).start()

def connects(addr):
    c = socket.socket(); c.settimeout(1.0)
    try:
        c.connect((addr, port)); return True
    except OSError:
        return False
    finally:
        c.close()

cut_alias, other = control_alias("127.0.0.11"), control_alias("127.0.0.12")
live = socket.create_connection((cut_alias, port), timeout=1.0)
faults = NetFaults()
out = {}
with faults.cut(cut_alias, [port]):
    out["new_conn_cut"] = not connects(cut_alias)
    out["other_node_open"] = connects(other)
    live.sendall(b"x" * 10)
    out["dropped"] = faults.dropped_packets()
    out["rules_while_cut"] = len(faults.active)
out["healed_new_conn"] = connects(cut_alias)
live.settimeout(5.0)
live.sendall(b"y")  # the established connection survives: TCP retransmits once healed
out["rules_after"] = len(faults.active)
print(json.dumps(out))
"""


def test_cut_drops_one_alias_for_real_and_heals():
    res = run_in_private_netns([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["new_conn_cut"] and out["other_node_open"] and out["healed_new_conn"], out
    assert out["dropped"] > 0 and out["rules_while_cut"] == 1 and out["rules_after"] == 0, out


def test_refuses_to_touch_the_machines_own_network():
    if in_private_netns():
        pytest.skip("this test process itself runs in a private namespace")  # pragma: no cover
    with pytest.raises(RuntimeError, match="private network namespace"):
        NetFaults()


def test_control_alias():
    assert control_alias("127.0.0.11") == "127.1.0.11"
    with pytest.raises(ValueError):
        control_alias("10.0.0.5")
