"""torch's rendezvous state is unpickled in one place (fleetd/shared/rendezvous_pickle.py), with
an allow-list, on the controller's path and on the agent's: the store is unauthenticated, and a
bare ``pickle.loads`` of its value runs whatever a writer on the network named."""

from __future__ import annotations

import base64
import os
import pickle
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.supervise import torchrun_main
from fleetd.protocol.errors import ProtocolError
from fleetd.rendezvous.errors import RendezvousStateError
from fleetd.rendezvous.state import NodeId, RendezvousState, decode, encode
from fleetd.shared.rendezvous_pickle import NULL_SENTINEL, unpickle_rendezvous_state

ROOT = Path(__file__).resolve().parent.parent
DECODER = ROOT / "fleetd" / "shared" / "rendezvous_pickle.py"
# Any way to unpickle: the functions, a hand-made Unpickler, or the names imported bare.
UNPICKLING = re.compile(r"pickle\.loads?\(|pickle\.Unpickler|from pickle import[^\n]*\bloads?\b")


class Evil:
    """Unpickling this calls os.system: exactly what the allow-list must refuse."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned",))


EVIL = base64.b64encode(pickle.dumps(Evil()))


@pytest.fixture
def no_system(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.system replaced by a recorder: a decoder that called it would show here, harmlessly."""
    calls: list[str] = []
    monkeypatch.setattr(os, "system", lambda cmd: calls.append(cmd) or 0)
    return calls


def test_no_unpickling_outside_the_one_decoder() -> None:
    found = []
    for top in ("fleetd", "agent"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == DECODER:
                continue
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                if UNPICKLING.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "unpickle only through fleetd.shared.rendezvous_pickle:\n" + "\n".join(found)


def test_the_decoder_refuses_a_pickle_that_calls_os_system(no_system: list[str]) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        unpickle_rendezvous_state(EVIL)
    assert no_system == []


@pytest.mark.parametrize("value", [b"not base64!!", base64.b64encode(b"not a pickle"), base64.b64encode(b"\x80\x05")])
def test_the_decoder_turns_garbage_into_a_protocol_error(value: bytes) -> None:
    with pytest.raises(ProtocolError, match="not torch's"):
        unpickle_rendezvous_state(value)


def test_controller_path_refuses_it(no_system: list[str]) -> None:
    with pytest.raises(RendezvousStateError, match="not allowed"):  # its callers' error type, as before
        decode(EVIL)
    assert no_system == []


class FakeLink:
    """The agent's StoreLink as _job_running uses it: one key, holding ``value``."""

    run_id = "job"

    def __init__(self, value: bytes):
        self.value = value

    def _op(self, name: str, *args: Any) -> Any:
        return True if name == "check" else self.value


def test_agent_path_refuses_it(no_system: list[str]) -> None:
    with pytest.raises(ProtocolError, match="not allowed"):
        torchrun_main._job_running(FakeLink(EVIL), "10.0.0.9")  # type: ignore[arg-type]
    assert no_system == []


def test_agent_joins_without_a_checkpoint_when_the_state_is_hostile(
    no_system: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's behaviour on a bad value is kept: no checkpoint asked, torchrun starts."""
    from agent.trainer import store_link

    class Link(FakeLink):
        def __init__(self, host: str, port: int, run_id: str):
            super().__init__(EVIL)

        def connect(self) -> Link:
            return self

        def request_checkpoint(self, *args: Any, **kwargs: Any) -> int:
            raise AssertionError("no checkpoint is asked for on a value that is not torch's")

    monkeypatch.setattr(store_link, "StoreLink", Link)
    for key, value in {"FLEETD_STORE": "127.0.0.1:1", "FLEETD_RUN_ID": "job", "FLEETD_NODE_ADDR": "10.0.0.9"}.items():
        monkeypatch.setenv(key, value)
    assert torchrun_main.checkpoint_before_join(0.1) is None
    assert no_system == []


def test_agent_path_still_reads_torchs_state() -> None:
    a, b = NodeId("10.0.0.1", 1, 0), NodeId("10.0.0.2", 2, 0)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    training = RendezvousState(round=2, complete=True, participants={a: 0, b: 1}, last_heartbeats={a: now, b: now})
    assert torchrun_main._job_running(FakeLink(encode(training)), "10.0.0.9")  # type: ignore[arg-type]
    assert not torchrun_main._job_running(FakeLink(encode(training)), "10.0.0.1")  # type: ignore[arg-type]
    assert not torchrun_main._job_running(FakeLink(NULL_SENTINEL), "10.0.0.9")  # type: ignore[arg-type]
