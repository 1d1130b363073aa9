"""node_with (the per-pass copy of a Node) is dataclasses.replace, field for field."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from fleetd.policy.model import Market, Node, NodePhase, PoolId, node_with

BASE = Node("i-1", PoolId("g5.xlarge", "us-east-1a"), Market.SPOT, 0.4, 1000.0, max_price_per_hour=0.5)
FLOATS = st.one_of(st.none(), st.floats(min_value=0, max_value=1e9, allow_nan=False))
CHANGES = st.fixed_dictionaries(
    {},
    optional={
        "phase": st.sampled_from(list(NodePhase)),
        "ec2_state": st.sampled_from(["pending", "running", "shutting-down", "terminated"]),
        "last_seen_at": FLOATS,
        "notice_at": FLOATS,
        "drain_started_at": FLOATS,
        "left_at": FLOATS,
        "gpu_util_pct": FLOATS,
        "steps_per_s": FLOATS,
        "step": st.one_of(st.none(), st.integers(0, 10**9)),
        "price_per_hour": st.floats(min_value=0, max_value=100, allow_nan=False),
    },
)


@given(CHANGES)
def test_node_with_is_replace(changes: dict) -> None:
    got = node_with(BASE, **changes)
    assert got == dataclasses.replace(BASE, **changes)
    assert type(got) is Node and got is not BASE
    assert all(getattr(got, f.name) == getattr(BASE, f.name) for f in dataclasses.fields(Node) if f.name not in changes)
    assert BASE.phase is NodePhase.PENDING  # the original is untouched
