"""agent/supervise/torchrun_main.py: a newcomer asks the running job for its hold checkpoint right
before its first join, once its warm pool is ready, not when torchrun starts (the running ranks
pause from that request until the new round trains)."""

from __future__ import annotations

import threading

from agent.supervise import torchrun_main


def test_the_hold_is_asked_once_right_before_the_first_join_with_the_pool_warm(tmp_path, monkeypatch):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    calls: list[object] = []
    sock = tmp_path / "pool.sock"
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", lambda self: calls.append("join") or "round")
    monkeypatch.setattr(
        torchrun_main, "checkpoint_before_join", lambda timeout_s: calls.append(("hold", sock.exists()))
    )
    monkeypatch.setenv("FLEETD_WARM_POOL", str(sock))
    assert torchrun_main._hold_before_first_join(1.0)
    assert calls == []  # torchrun starting asks nothing of the running ranks
    threading.Timer(0.3, sock.touch).start()  # the pool finishes importing torch
    handler = object()
    assert DynamicRendezvousHandler.next_rendezvous(handler) == "round"  # type: ignore[arg-type]
    assert DynamicRendezvousHandler.next_rendezvous(handler) == "round"  # type: ignore[arg-type]
    assert calls == [("hold", True), "join", "join"]  # asked once, after the pool, before joining


def test_without_a_pool_the_hold_is_asked_at_the_first_join_without_waiting(monkeypatch):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    calls: list[str] = []
    monkeypatch.setattr(DynamicRendezvousHandler, "next_rendezvous", lambda self: calls.append("join"))
    monkeypatch.setattr(torchrun_main, "checkpoint_before_join", lambda timeout_s: calls.append("hold"))
    monkeypatch.delenv("FLEETD_WARM_POOL", raising=False)
    torchrun_main._hold_before_first_join(1.0)
    DynamicRendezvousHandler.next_rendezvous(object())  # type: ignore[arg-type]
    assert calls == ["hold", "join"]
