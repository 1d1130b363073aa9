"""The EC2 view's whole-fleet DescribeInstances, parsed in a child process.

Parsing 2,000 instances is seconds of botocore CPU; in a worker thread it held the GIL against the
event loop and delayed a notice's drain by 2.3 s (bench/agents_load.py). ``ProcessLister`` is
Ec2View's ``lister``: each call asks a child over a pipe for the instances (or the translated AWS
error). The child is started on the first call, keeps its client, exits when its pipe closes and
is replaced on the next call if it died. (docs/DESIGN.md "How far one control host goes")
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

from fleetd.adapters.aws_errors import AwsError, TransientAwsError
from fleetd.adapters.ec2 import Ec2Instance
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# A listing of 2,000 instances on moto took up to 56 s; AWS answers in seconds.
LIST_TIMEOUT_S = 300.0
CLOSE_GRACE_S = 2.0


class ProcessLister:
    """``client_kwargs`` (region, endpoint, botocore Config) and ``profile``: the child's
    synchronous EC2 client, the same as the daemon's async one."""

    def __init__(self, client_kwargs: dict[str, Any], profile: str | None, fleet: str) -> None:
        self._args = (dict(client_kwargs), profile, fleet)
        self._ctx = multiprocessing.get_context("spawn")  # nothing of the daemon's threads or loop is copied
        self._proc: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one listing at a time over the one pipe
        # Guards _proc and _closed only (held for no I/O but a start): close() must see a child
        # started concurrently, or the start must see close().
        self._proc_lock = threading.Lock()
        self._closed = False

    def __call__(self) -> list[Ec2Instance]:
        with self._lock:
            if self._closed:
                raise TransientAwsError("DescribeInstances", "ListerClosed", "the daemon is stopping")
            conn = self._ensure_child()
            try:
                conn.send("list")
                if not conn.poll(LIST_TIMEOUT_S):
                    self._stop_child()
                    raise TransientAwsError(
                        "DescribeInstances",
                        "ListerTimeout",
                        f"no answer from the listing process in {LIST_TIMEOUT_S:.0f} s",
                    )
                kind, payload = conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._stop_child()  # it died: the next call starts a new one
                raise TransientAwsError("DescribeInstances", "ListerDied", str(exc) or type(exc).__name__) from None
        if kind == "error":
            raise payload
        instances: list[Ec2Instance] = payload
        return instances

    def close(self) -> None:
        """Bounded: not behind a listing in flight (it holds the lock for as long as AWS takes).
        Killing the child ends that listing's wait with EOF; its thread cleans up after it."""
        with self._proc_lock:
            self._closed = True
            proc = self._proc
        if proc is not None:
            proc.kill()
            proc.join(CLOSE_GRACE_S)

    def _ensure_child(self) -> Connection:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            return self._conn
        self._stop_child()
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, *self._args), name="fleetd-ec2-lister", daemon=True)
        with self._proc_lock:
            if self._closed:
                parent.close()
                child.close()
                raise TransientAwsError("DescribeInstances", "ListerClosed", "the daemon is stopping")
            proc.start()
            self._proc, self._conn = proc, parent
        child.close()
        log.info("ec2_lister_started", pid=proc.pid)
        return parent

    def _stop_child(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the child's recv sees EOF and exits
            self._conn = None
        if self._proc is not None:
            self._proc.join(CLOSE_GRACE_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(CLOSE_GRACE_S)
            self._proc = None


def sync_ec2_client(client_kwargs: dict[str, Any], profile: str | None) -> Any:
    """A synchronous botocore EC2 client (the daemon's own clients are aiobotocore's)."""
    import botocore.session

    session = botocore.session.get_session()
    if profile:
        session.set_config_variable("profile", profile)
    return session.create_client("ec2", **client_kwargs)


def _serve(conn: Connection, client_kwargs: dict[str, Any], profile: str | None, fleet: str) -> None:
    """The child: answer each request with ("ok", instances) or ("error", AwsError)."""
    from fleetd.adapters.ec2 import AioEc2
    from fleetd.adapters.ec2_view import blocking_lister

    listing = blocking_lister(AioEc2(None, fleet=fleet, job=""), sync_ec2_client(client_kwargs, profile))
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            return  # the daemon closed the pipe (or died)
        try:
            answer: tuple[str, Any] = ("ok", listing())
        except AwsError as exc:
            answer = ("error", exc)
        except Exception as exc:  # noqa: BLE001 - a malformed answer: a failed listing, as in ec2_view
            answer = ("error", TransientAwsError("DescribeInstances", type(exc).__name__, str(exc)[:300]))
        try:
            conn.send(answer)
        except (OSError, BrokenPipeError):
            return
