"""A warm pool for torchrun's workers: a process that has already imported torch (and the script's
modules) forks each worker torchrun starts, in tens of milliseconds instead of the seconds a fresh
Python takes to import torch, which dominated "notice -> survivors training again".

The supervisor (agent/supervise/torchrun.py) runs ``python -m agent.supervise.warm_pool`` beside
torchrun, whose entrypoint becomes ``-m agent.supervise.warm_launch``: it hands argv, environment,
cwd and stdio to the pool over a unix socket, relays signals and exits with the worker's status;
without a pool it execs a cold worker. (docs/DESIGN.md "Durable checkpoints", rendezvous facts)
"""

from __future__ import annotations

import argparse
import array
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any

MAX_MSG = 1 << 20
# How long a stopped pool waits for its children before SIGKILLing them: torchrun's own grace
# between SIGTERM and SIGKILL (PContext.close), so a worker's salvage is never cut shorter here.
STOP_GRACE_S = 30.0


def recv_msg(conn: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One length-prefixed JSON message, with up to ``max_fds`` file descriptors attached."""
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(4, socket.CMSG_LEN(max_fds * fds.itemsize) if max_fds else 0)
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if len(data) < 4:
        raise ConnectionError("peer closed")
    (size,) = struct.unpack("!I", data)
    if size > MAX_MSG:
        raise ConnectionError(f"message of {size} bytes")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("peer closed")
        body += chunk
    return json.loads(body), list(fds)


def send_msg(conn: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(msg).encode()
    header = struct.pack("!I", len(body))
    if fds:
        conn.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        conn.sendall(body)
    else:
        conn.sendall(header + body)


def exit_code(status: int) -> int:
    """waitpid status -> shell-style code (negative: killed by that signal)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _run_worker(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the worker torchrun asked for, then exit."""
    # Here, not at the top: warm_launch imports this module and must stay stdlib-fast; the pool
    # has agent.trainer loaded already.
    from agent.trainer import worker_exit

    code = 1
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds, strict=False):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        # A fresh mask, whatever the pool inherited: a SIGTERM blocked here would leave the worker
        # deaf to torchrun's stop (and its salvage) until torchrun's SIGKILL.
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])

        def die_with_launcher() -> None:
            try:
                conn.recv(1)
            except OSError:
                pass
            os.killpg(0, signal.SIGKILL)

        threading.Thread(target=die_with_launcher, daemon=True, name="warm-pool-lifeline").start()
        # Workers of a round start within milliseconds here: a rank that is not 0 would try rank
        # 0's store before it listens and back off for ~0.5 s (agent/supervise/master_wait.py).
        from agent.supervise import master_wait

        master_wait.install()
        argv = request["argv"]
        sys.argv = list(argv)
        if request.get("module", True):
            # The pool imported the entrypoint only to warm its dependencies; run it afresh.
            sys.modules.pop(argv[0], None)
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            # As ``python <path>`` would: the script's own folder first on the path, where the
            # pool (``python -m``) had its working directory.
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = worker_exit.status_of(exc)
    except BaseException:  # noqa: BLE001 - report like an uncaught exception would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        worker_exit.exit_now(code)  # no interpreter teardown (agent/trainer/worker_exit.py)


def warm_torch_lazily_imported_parts() -> None:
    """Constructing the first optimizer imports ~800 modules (torch._dynamo, sympy, ...): about a
    second of CPU in every fresh worker. Do it once here. It runs no tensor op, starts no thread
    (checked in tests), so forking afterwards stays safe."""
    if "torch" not in sys.modules:
        return
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def warm_s3_client_data() -> None:
    """Every worker's ``resume()`` reads S3's ``latest`` through a fresh botocore session, which
    parsed botocore's data files again: ~0.1-0.3 s of CPU in each worker of each re-form. Parse
    them once here (agent.checkpoint_store.s3.warm_client_data: files only, no thread, no network)."""
    if "agent.checkpoint_store.s3" not in sys.modules:
        return  # not preloaded: this pool's workers do not use the checkpoint store
    from agent.checkpoint_store.s3 import warm_client_data

    try:
        warm_client_data()
    except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs warmth
        print(f"warm_pool: cannot warm the S3 client data: {exc}", file=sys.stderr)


def serve(socket_path: str, preload: list[str]) -> None:
    _preload(preload)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    pool = _Pool(listener)
    signal.signal(signal.SIGTERM, pool.request_stop)
    signal.signal(signal.SIGINT, pool.request_stop)
    pool.sel.register(listener, selectors.EVENT_READ)
    print(f"warm_pool: ready on {socket_path} (preloaded {', '.join(preload)})", file=sys.stderr, flush=True)
    pool.run()
    for pid in list(pool.children):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass


def _preload(preload: list[str]) -> None:
    """Import what every worker needs, then hide it from the garbage collector."""
    # Imports only, never a torch op (the forkserver/zygote technique): no OpenMP or gloo thread
    # exists for fork to break.
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a bad preload only costs warmth
            print(f"warm_pool: cannot preload {name}: {exc}", file=sys.stderr)
    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
        print("warm_pool: a preload started threads; forked workers may misbehave", file=sys.stderr)
    # Everything imported so far is shared with every forked worker. Move it out of the garbage
    # collector's sight: a collection in a worker would otherwise touch every object and copy
    # the whole heap page by page (seconds of CPU on a busy machine).
    gc.collect()
    gc.freeze()


class _Pool:
    """The serving loop's state: the listening socket, the forked workers (pid -> their launcher's
    connection), and the stop asked for by a signal."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.stop = False
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}
        # A pidfd per child, watched with the listener: a worker's exit wakes the loop at once,
        # so torchrun learns it within a millisecond instead of at the next 50 ms turn (on the
        # path from a notice to training again). Empty where the kernel has no pidfd_open.
        self.pidfds: dict[int, int] = {}
        self.warmed = False
        self.stop_deadline: float | None = None

    def request_stop(self, *_: object) -> None:
        """The SIGTERM/SIGINT handler: the loop notices at its next turn."""
        self.stop = True

    def run(self) -> None:
        """Fork a worker for every request until stopped and every child is gone (or the grace ends)."""
        while True:
            if self.stop and self._stopped_and_done():
                break
            ready = self.sel.select(timeout=0.05)
            if not ready and not self.warmed and self.children and not self.stop:
                # The first fork (a joining node's torchrun) is served before this second of warm-up,
                # which then overlaps with that torchrun's own start and rendezvous.
                warm_torch_lazily_imported_parts()
                warm_s3_client_data()
                gc.collect()
                gc.freeze()
                self.warmed = True
            for key, _ in ready:
                if key.fileobj is self.listener:
                    self._fork_for_next_request()
            self._reap()

    def _stopped_and_done(self) -> bool:
        # Stopped (the supervisor SIGTERMs the whole tree): fork nothing more, but outlive the
        # children for a while. They got the same SIGTERM and may be saving the step they
        # completed (agent/trainer/salvage.py); killing them now would throw that away, and
        # their launchers would lose their exit status.
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + STOP_GRACE_S
            self.sel.unregister(self.listener)
        return not self.children or time.monotonic() >= self.stop_deadline

    def _fork_for_next_request(self) -> None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(5)
            request, fds = recv_msg(conn, max_fds=3)
            conn.settimeout(None)
        except (OSError, ValueError, ConnectionError) as exc:
            print(f"warm_pool: bad request: {exc}", file=sys.stderr)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.sel.close()
            self.listener.close()
            for other in self.children.values():
                other.close()
            for pidfd in self.pidfds.values():
                os.close(pidfd)
            _run_worker(conn, request, fds)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self._watch_exit(pid)
        try:
            send_msg(conn, {"pid": pid})
        except OSError:
            pass

    def _watch_exit(self, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # an old kernel (or an exited pid): the 50 ms turn reaps it
            return
        self.pidfds[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ)

    def _reap(self) -> None:
        """Reap finished workers and tell their launchers how they ended."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            pidfd = self.pidfds.pop(pid, None)
            if pidfd is not None:
                self.sel.unregister(pidfd)
                os.close(pidfd)
            done = self.children.pop(pid, None)
            if done is not None:
                try:
                    send_msg(done, {"exit": exit_code(status)})
                except OSError:
                    pass
                done.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pre-warmed worker pool for torchrun (see module doc)")
    p.add_argument("--socket", required=True)
    p.add_argument("--preload", action="append", default=[])
    args = p.parse_args(argv)
    serve(args.socket, args.preload or ["torch", "torch.distributed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
