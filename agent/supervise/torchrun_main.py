"""``python -m agent.supervise.torchrun_main <torchrun args>``: torchrun, patched for fleetd.

It polls the rendezvous every ``FLEETD_RDZV_POLL_S`` (0.1 s) instead of every second, rides
through a store outage (store_ride.py), and right before it enters a running job's wait list (its
warm pool ready) asks that job for a checkpoint with hold (folder mode: every round starts on the
newest folder version, folder_gate.py).
Everything else is torchrun unchanged; if torch's internals changed it runs as is (slower, still
correct). (docs/DESIGN.md "One interruption, end to end", "Rendezvous store crash")
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.trainer.store_link import StoreLink


def _patch(poll_s: float) -> bool:
    # torch polls the store once a second while a round completes (``_delay(seconds=1)``) and serves
    # a cached state for up to a second (``cache_duration=1``, the agent's num_nodes_waiting check
    # too). fleetd completes rounds within milliseconds, so those two seconds dominated a membership
    # change; ``poll_s`` replaces both, at a few small store requests per second per node.
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
        from torch.distributed.elastic.rendezvous import utils

        holder_init = dr._BackendRendezvousStateHolder.__init__
        if holder_init.__defaults__ != (1,) or not callable(getattr(dr, "_delay", None)):
            raise AttributeError("torch's rendezvous internals changed")
        holder_init.__defaults__ = (poll_s,)
        original_delay = utils._delay

        def _delay(seconds: float | tuple[float, float]) -> None:  # same signature as torch's
            if seconds == 1:  # the fixed poll of a waiting join; random skews pass through
                seconds = poll_s
            return original_delay(seconds)

        dr._delay = _delay  # type: ignore[attr-defined]  # patching torch's private helper
        return True
    except (ImportError, AttributeError) as exc:
        print(f"fleetd: running torchrun unpatched: {exc}", file=sys.stderr)
        return False


# torchrun's exit status when its own rendezvous failed (not a worker): a round completed with a
# rank 0 that never published its address (it left as the round closed), a join that timed out.
# The cloud's fault, never the job's: the agent starts torchrun again (agent/supervise/
# store_watch.py) and fleetd counts no restart of the job against it. EX_TEMPFAIL; torchrun
# itself exits 1 when a worker fails.
RENDEZVOUS_FAILED_EXIT = 75


def _rendezvous_failure(exc: BaseException) -> bool:
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError

    if isinstance(exc, RendezvousGracefulExitError):
        return False  # torchrun ends quietly on it (a redundant node): not a failure
    return isinstance(exc, (RendezvousError, DistError))


def _job_running(link: StoreLink, node_addr: str) -> bool:
    """Is a round complete with other participants (i.e. are ranks training right now)?

    A value that is not torch's state raises ProtocolError (a ValueError: the caller joins
    without a checkpoint, as for any other failure to ask)."""
    from fleetd.shared.rendezvous_pickle import unpickle_rendezvous_state

    key = "torch.rendezvous." + link.run_id
    if not link._op("check", [key]):
        return False
    # The store is unauthenticated: the controller's allow-list decoder, not a bare pickle.loads.
    state = unpickle_rendezvous_state(link._op("get", key))
    if state is None:  # torch's "no state yet" sentinel
        return False
    return bool(
        state.complete
        and state.participants
        and not state.closed
        and all(n.addr != node_addr for n in state.participants)
    )


def checkpoint_before_join(timeout_s: float) -> int | None:
    """Ask the running job to save and hold; return the saved step (None: nothing to wait for).

    A newcomer in the wait list makes every running node restart its workers; without this save
    they would lose every step since their last checkpoint."""
    store, run_id, addr = (os.environ.get(k) for k in ("FLEETD_STORE", "FLEETD_RUN_ID", "FLEETD_NODE_ADDR"))
    if not store or not run_id:
        return None
    import time

    from agent.trainer.store_link import StoreLink, StoreLinkError

    host, _, port = store.rpartition(":")
    try:
        link = StoreLink(host, int(port), run_id).connect()
        if not _job_running(link, addr or ""):
            return None
        seq = link.request_checkpoint(f"{addr} joins", hold=True, by=addr or "")
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            acks = link.acks(seq)
            if acks and len({a.rank for a in acks}) >= acks[0].world_size:
                step = max(a.step for a in acks)
                print(f"fleetd: the job saved step {step} before this node joins", file=sys.stderr)
                return step
            time.sleep(0.02)
        print("fleetd: no checkpoint before joining (ranks did not answer in time)", file=sys.stderr)
    except (StoreLinkError, OSError, ValueError, AttributeError) as exc:
        print(f"fleetd: no checkpoint before joining: {exc}", file=sys.stderr)
    return None


# How long a newcomer's first join waits for its warm pool (agent/supervise/warm_pool.py) to
# finish importing torch (seconds; ~15 s seen on a loaded 2-core box). Past that (or a pool that
# died) it joins anyway: warm_launch then starts its first workers cold.
POOL_WAIT_S = 30.0


def _wait_for_warm_pool(timeout_s: float) -> None:
    """The pool creates its socket once torch is imported (warm_pool.serve)."""
    import time

    sock = os.environ.get("FLEETD_WARM_POOL")
    until = time.monotonic() + timeout_s
    while sock and not os.path.exists(sock) and time.monotonic() < until:
        time.sleep(0.05)


def _hold_when_wait_listed(timeout_s: float) -> bool:
    """Ask the running job for its hold checkpoint at the moment this node adds itself to the wait
    list of a formed round: that entry is what makes the running agents restart their workers.

    Deciding earlier (at the first ``next_rendezvous``) raced the running world's own round: a
    newcomer that looked while that round was still open asked for nothing, then found it
    formed and wait-listed itself, and the running node restarted from its last checkpoint
    (558 steps lost in a store-outage test on a loaded box). The join operation's own decision,
    made on the state it just synced, has no such window. A member's own re-form asks nothing; a
    member that finds a round formed without it (it restarted late) asks like a newcomer: that
    world trained and restarts for it. The pool wait stays at the first
    ``next_rendezvous``: the hold should start when this node is ready to train, not while it
    imports torch (the running ranks stop at the request). False: torch changed; asked at once."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        handler, executor = dr.DynamicRendezvousHandler, dr._DistributedRendezvousOpExecutor
        original_next, original_add = handler.next_rendezvous, executor._add_to_wait_list
    except (ImportError, AttributeError) as exc:
        print(f"fleetd: asking for the join checkpoint at start: {exc}", file=sys.stderr)
        checkpoint_before_join(timeout_s)
        return False
    pool_waited = False
    asked_rounds: set[int] = set()
    trained_in: int | None = None  # the newest round this torchrun joined (None: a newcomer)

    def next_rendezvous(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal pool_waited, trained_in
        if not pool_waited:  # later calls are this member's own re-forms: its pool is long ready
            pool_waited = True
            _wait_for_warm_pool(POOL_WAIT_S)
        info = original_next(self, *args, **kwargs)
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        trained_in = getattr(state, "round", trained_in)
        return info

    def _add_to_wait_list(self: Any) -> None:
        formed = self._state.round
        # A member restarting its own workers leaves its round and, while the others are still
        # in it, wait-lists on that same round: nobody is training to save for (its ranks are
        # stopping too), and a request there waited out the whole timeout for acks that never
        # came while the others formed a round without it (worlds of 2, 3, 2 and 4 in one scale-up
        # under load). A round formed after its own did train without it: that one is asked.
        # (Equal, not at-or-below: a store that came back empty counts rounds from 0 again.)
        own_round = formed == trained_in
        # One request per formed round: a stale local state (someone's keep-alive landed while
        # the ranks saved) fails the sync and brings the same decision back for the same round.
        if not own_round and formed not in asked_rounds and self._state.participants:
            asked_rounds.add(formed)
            try:
                checkpoint_before_join(timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failure to ask never stops the join
                print(f"fleetd: no checkpoint before joining: {exc!r}", file=sys.stderr)
        original_add(self)

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    executor._add_to_wait_list = _add_to_wait_list  # type: ignore[method-assign]
    return True


def main() -> None:
    _patch(float(os.environ.get("FLEETD_RDZV_POLL_S", "0.1")))
    from agent.supervise import store_ride

    store_ride.install()  # a store restart no longer ends the workers (store_ride's docstring)
    from agent.supervise import rdzv_events

    rdzv_events.install()  # rendezvous events named without walking the stack (~0.5 s of a re-form)
    from agent.supervise import tail_poll

    tail_poll.install()  # a stopped worker group's output copiers end within 20 ms, not 100-200
    folder_gate = os.environ.get("FLEETD_FOLDER_GATE")  # folder_gate.GATE_ENV, set by folder_hooks.py
    if folder_gate:
        # Folder mode: the ranks cannot be asked for a checkpoint (the script imports nothing
        # from fleetd); instead every round starts on the world's newest version.
        from agent.supervise.folder_gate import install

        install(folder_gate)
    else:
        _hold_when_wait_listed(float(os.environ.get("FLEETD_JOIN_CKPT_TIMEOUT_S", "10")))
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except Exception as exc:
        if not _rendezvous_failure(exc):
            raise
        # torch's own traceback is already in the log (its @record wrapper printed it).
        print(f"fleetd: torchrun's rendezvous failed ({type(exc).__name__}): no worker ran", file=sys.stderr)
        sys.exit(RENDEZVOUS_FAILED_EXIT)


if __name__ == "__main__":
    main()
