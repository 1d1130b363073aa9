"""The rendezvous endpoint message (controller -> agents, retained): versioned, strict."""

from __future__ import annotations

import json

import pytest

from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.messages import RendezvousEndpoint, parse_endpoint
from fleetd.protocol.topics import rendezvous_topic


def test_round_trip_and_topic() -> None:
    ep = RendezvousEndpoint(host="10.0.1.10", port=29400, run_id="job", leader="ctl-b", generation=7)
    assert parse_endpoint(ep.to_json()) == ep
    assert rendezvous_topic("jobA") == "fleetd/jobA/rendezvous"
    with pytest.raises(ProtocolError):
        rendezvous_topic("job/A")


@pytest.mark.parametrize(
    "change", [{"schema_version": 2}, {"port": 0}, {"extra": 1}, {"kind": "drain"}, {"host": ""}, {"generation": -1}]
)
def test_bad_endpoints_are_refused_with_a_reason(change: dict) -> None:
    raw = json.loads(RendezvousEndpoint(host="h", port=1, run_id="r", leader="a", generation=1).to_json())
    raw.update(change)
    with pytest.raises(ProtocolError) as err:
        parse_endpoint(json.dumps(raw))
    assert str(err.value)
