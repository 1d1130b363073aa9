"""torchrun supervision: the command line and environment from config, the warm worker pool, and
stopping whole process trees."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from agent.config import AgentConfig
from agent.supervise.launch import LaunchSpec, build_command, build_env
from agent.supervise.proctree import kill_tree, process_tree
from agent.supervise.torchrun import TorchrunProcess
from agent.supervise.warm_pool import _Pool


def test_command_carries_the_job_spec_and_tuned_rendezvous(tmp_path):
    cfg = AgentConfig.model_validate(
        {
            "node": {"min_nodes": 2, "max_nodes": 6, "trainer_socket": str(tmp_path / "t.sock")},
            "rendezvous": {"host": "10.0.0.5", "port": 29411, "run_id": "llm", "last_call_timeout_s": 1.5},
            "job": {"entrypoint": "my.train", "args": ["--lr", "3e-4"], "nproc_per_node": 4, "name": "llm"},
            "checkpoints": {"local_dir": str(tmp_path / "ckpt"), "interval_steps": 50, "bucket": "b"},
        }
    )
    spec = LaunchSpec.from_config(cfg, node_addr="10.0.1.7")
    cmd = build_command(spec)
    assert "--nnodes=2:6" in cmd and "--nproc-per-node=4" in cmd
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=10.0.0.5:29411" in cmd and "--rdzv-id=llm" in cmd
    conf = next(a for a in cmd if a.startswith("--rdzv-conf=")).split("=", 1)[1].split(",")
    assert "is_host=false" in conf and "last_call_timeout=2" in conf and "join_timeout=600" in conf
    assert "--local-addr=10.0.1.7" in cmd
    assert cmd[-3:] == ["my.train", "--lr", "3e-4"]
    env = build_env(spec, {"PATH": "/bin", "NOTIFY_SOCKET": "/run/systemd/notify"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["FLEETD_STORE"] == "10.0.0.5:29411" and env["FLEETD_NODE_ADDR"] == "10.0.1.7"
    assert env["FLEETD_CKPT_DIR"] == str(tmp_path / "ckpt" / "llm") and env["FLEETD_CKPT_INTERVAL"] == "50"
    assert env["FLEETD_S3_BUCKET"] == "b" and "NOTIFY_SOCKET" not in env


def test_plain_torchrun_without_fleetds_patches():
    spec = LaunchSpec(entrypoint="train.py", module=False, rdzv_poll_s=None, warm_pool=False)
    cmd = build_command(spec)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-1] == "train.py" and "-m" not in cmd[3:]


def _write_module(pkg_dir: Path, name: str, body: str) -> str:
    pkg_dir.mkdir(parents=True, exist_ok=True)
    (pkg_dir / "__init__.py").touch()
    (pkg_dir / f"{name}.py").write_text(textwrap.dedent(body))
    return f"{pkg_dir.name}.{name}"


def launch(sock: str, env: dict, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agent.supervise.warm_launch", *argv],
        env={**env, "FLEETD_WARM_POOL": sock},
        stdout=subprocess.PIPE,
        **kw,
    )


def _signal_state(pid: int) -> str:
    """What a process that ignores a signal looks like from outside: its masks and what each of
    its threads waits in. A timeout says this instead of only "timed out"."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        lines = [
            ln
            for ln in status
            if ln.startswith(("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        ]
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            comm = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            wchan = Path(f"/proc/{pid}/task/{task}/wchan").read_text().strip()
            masks = [
                ln
                for ln in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines()
                if ln.startswith(("SigPnd", "SigBlk"))
            ]
            lines.append(f"task {task} {comm} in {wchan} {' '.join(masks)}")
        return f"pid {pid}: " + "; ".join(lines)
    except OSError as exc:
        return f"pid {pid}: {exc}"


def _pool_pid(sock: str) -> int:
    return next(
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if sock in (p.info["cmdline"] or []) and "agent.supervise.warm_pool" in p.info["cmdline"]
    )


def finish(proc: subprocess.Popen, *also: int, timeout: float = 30) -> bytes:
    """``communicate`` that, on a timeout, names the signal state of the launcher and ``also``."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        state = "\n".join(_signal_state(pid) for pid in (proc.pid, *also))
        proc.kill()
        pytest.fail(f"the launcher did not exit within {timeout} s:\n{state}")


def test_warm_worker_gets_argv_env_stdio_and_exit_code(tmp_path, pool):
    sock, env = pool
    mod = _write_module(
        tmp_path / "wp_mods",
        "echo",
        """
        import os, sys
        print("argv", sys.argv[1:], "env", os.environ.get("WHO"), "main", __name__, flush=True)
        sys.exit(7)
    """,
    )
    proc = launch(sock, {**env, "WHO": "rank3"}, mod, "--x", "1")
    out = finish(proc, _pool_pid(sock))
    assert proc.returncode == 7
    assert out.decode().strip() == "argv ['--x', '1'] env rank3 main __main__"


def test_signals_reach_the_warm_worker_and_it_dies_with_its_launcher(tmp_path, pool):
    sock, env = pool
    mod = _write_module(
        tmp_path / "wp_mods",
        "sleeper",
        """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("term", flush=True), sys.exit(3)))
        print(os.getpid(), flush=True)
        time.sleep(60)
    """,
    )
    proc = launch(sock, env, mod)
    worker = int(proc.stdout.readline())
    assert worker != proc.pid and psutil.pid_exists(worker)
    proc.send_signal(signal.SIGTERM)  # what torchrun does to stop a worker
    out = finish(proc, worker, _pool_pid(sock))
    assert proc.returncode == 3 and b"term" in out

    proc = launch(sock, env, mod)
    # Held before the kill: the pool may reap the worker before a lookup after it would run.
    worker_proc = psutil.Process(int(proc.stdout.readline()))
    proc.kill()  # torchrun SIGKILLs a launcher that does not stop
    proc.wait()
    assert psutil.wait_procs([worker_proc], timeout=10)[1] == []


SLOW_SAVER = """
    import os, signal, sys, time
    def save(*_):
        time.sleep(1.0)  # a salvage that takes a while (a loaded box, a big model)
        open(sys.argv[1], "w").write("saved")
        sys.exit(3)
    signal.signal(signal.SIGTERM, save)
    print(os.getpid(), flush=True)
    time.sleep(60)
"""


def test_a_whole_tree_sigterm_leaves_a_warm_worker_time_to_save(tmp_path, pool):
    """The supervisor SIGTERMs every process of the tree at once, the pool included (issue 19: a
    pool that SIGKILLed its children on SIGTERM threw away the salvage of a store move). The pool
    outlives its children; the worker saves and its launcher reports its exit status."""
    sock, env = pool
    mod = _write_module(tmp_path / "wp_mods", "saver", SLOW_SAVER)
    marker = tmp_path / "saved"
    proc = launch(sock, env, mod, str(marker))
    int(proc.stdout.readline())
    pool_pid = _pool_pid(sock)
    pool_proc = psutil.Process(pool_pid)  # held before the stop: it may be gone before a later lookup
    tree = process_tree(proc.pid) + process_tree(pool_pid)
    kill_tree(tree, signal.SIGTERM)
    finish(proc, pool_pid)
    assert marker.read_text() == "saved"
    assert proc.returncode == 3, "the launcher got the worker's own exit status"
    assert psutil.wait_procs([pool_proc], timeout=10)[1] == [], "the stopped pool exits after its children"


def test_wait_returns_only_once_a_stopped_tree_is_gone(tmp_path):
    """A launcher that exits at once on SIGTERM while its child is still saving: ``wait`` (the run
    loop, which starts the next torchrun as soon as it returns) must not return before the child
    is gone, or the next torchrun resumes from an older checkpoint than the one being written."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(SLOW_SAVER))
    marker = tmp_path / "saved"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        textwrap.dedent(f"""
        import subprocess, sys, time
        c = subprocess.Popen([sys.executable, {str(child)!r}, {str(marker)!r}], start_new_session=True,
                             stdout=subprocess.PIPE)
        c.stdout.readline()
        print("ready", flush=True)
        time.sleep(60)
    """)
    )
    spec = LaunchSpec(
        entrypoint=str(launcher), module=False, warm_pool=False, rdzv_poll_s=None, ckpt_dir=tmp_path / "ckpt"
    )
    proc = TorchrunProcess(spec)
    proc.proc = subprocess.Popen([sys.executable, str(launcher)], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.proc.stdout.readline().strip() == b"ready"
    stopper = threading.Thread(target=proc.terminate, args=(20.0,))
    stopper.start()
    try:
        assert proc.wait_blocking().reason == "stopped"
        assert marker.exists(), "wait returned while the stopped tree was still saving"
    finally:
        stopper.join()


def test_without_a_pool_the_launcher_starts_a_cold_worker(tmp_path):
    mod = _write_module(tmp_path / "wp_mods", "cold", "print('cold ok')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FLEETD_WARM_WAIT_S": "0.1"}
    out = subprocess.run(
        [sys.executable, "-m", "agent.supervise.warm_launch", mod],
        env={**env, "FLEETD_WARM_POOL": str(tmp_path / "absent.sock")},
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == b"cold ok"


def test_the_launcher_imports_only_the_standard_library_and_the_pool_protocol():
    """torchrun starts warm_launch for every worker of every round: its imports are on the
    notice -> training path (~16 ms with the stdlib alone; pulling in agent.trainer made it
    ~140 ms idle and several times that on a loaded box)."""
    code = (
        "import sys; before = set(sys.modules); import agent.supervise.warm_launch; "
        "print(' '.join(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) <= {
        "agent",
        "agent.supervise",
        "agent.supervise.warm_pool",
        "agent.supervise.warm_launch",
    }


def test_pool_warm_up_starts_no_threads(tmp_path):
    code = (
        "import os, threading; from agent.supervise.warm_pool import warm_torch_lazily_imported_parts as w, "
        "warm_s3_client_data as w3; import torch, agent.checkpoint_store.store; w(); w3(); "
        "print(threading.active_count(), len(os.listdir('/proc/self/task')))"
    )
    # the supervisor starts the pool with OPENBLAS_NUM_THREADS=1 (numpy's BLAS pool is a thread)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )
    assert out.stdout.split() == ["1", "1"], out.stderr


def test_stop_kills_the_whole_tree_including_new_sessions(tmp_path):
    # torchrun-like: a parent whose child starts its own session (as torch's workers do).
    script = tmp_path / "tree.py"
    script.write_text(
        textwrap.dedent("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        time.sleep(60)
    """)
    )
    spec = LaunchSpec(
        entrypoint=str(script), module=False, warm_pool=False, rdzv_poll_s=None, ckpt_dir=tmp_path / "ckpt"
    )
    proc = TorchrunProcess(spec)
    proc.proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    for _ in range(100):
        tree = process_tree(proc.proc.pid)
        if len(tree) >= 2:
            break
        time.sleep(0.05)
    assert len(tree) >= 2
    proc.kill()
    assert proc.wait_blocking().reason == "stopped"
    assert psutil.wait_procs(tree, timeout=10)[1] == []


def test_a_failure_read_after_our_own_kill_leaves_the_exit_stopped(tmp_path):
    """A leave SIGKILLs the tree; a worker can die before torchrun does, torchrun logs its death
    as a failure, and the failure guard reads that line: our stop, not a bug in the job (burner
    run 37 recorded "failed" and waited for a restart command that never came)."""
    spec = LaunchSpec(
        entrypoint="train.py", module=False, warm_pool=False, rdzv_poll_s=None, ckpt_dir=tmp_path / "ckpt"
    )
    proc = TorchrunProcess(spec)
    proc.proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True)
    proc.kill()
    assert proc.stopping
    proc.fail(-9)  # what the guard would call on the worker's logged death
    exit_ = proc.wait_blocking()
    assert (exit_.reason, exit_.job_failed) == ("stopped", False)


@contextlib.asynccontextmanager
async def _hooks_beside_a_store(
    tmp_path, run_id: str, instance_id: str, train_args: tuple[str, ...] = ("--steps", "100000")
):
    """Real ElasticHooks for node 127.0.0.2 beside a real rendezvous store (LocalCluster); yields
    (hooks, cluster, published events, states set)."""
    import asyncio

    from agent.supervise.elastic_hooks import ElasticHooks
    from fleetd.rendezvous.localcluster import LocalCluster

    events, states = [], []

    async def publish(msg):
        events.append(msg)

    async def set_state(state):
        states.append(state)

    cluster = LocalCluster(tmp_path / "job", run_id=run_id, train_args=train_args)
    try:
        await asyncio.to_thread(cluster.start_host)
        hooks = ElasticHooks(
            spec=cluster.spec("127.0.0.2"),
            instance_id=instance_id,
            publish_event=publish,
            set_state=set_state,
            log_path=tmp_path / "torchrun.log",
        )
        yield hooks, cluster, events, states
    finally:
        await asyncio.to_thread(cluster.close)


@pytest.mark.slow
async def test_agent_hooks_supervise_torchrun_and_leave_on_command(tmp_path):
    """The agent's hooks for a training node (ElasticHooks): run() starts torchrun, a leave command stops the whole
    tree, confirms it in the store, and the exit is reported as a trainer-exited event."""
    import asyncio

    from agent.trainer.store_link import StoreLink
    from fleetd.protocol.messages import LeaveCommand, TrainerExited

    async with _hooks_beside_a_store(tmp_path, "hooks", "i-hooks") as (hooks, cluster, events, states):
        runner = asyncio.create_task(hooks.run())
        t0 = time.time()
        await asyncio.to_thread(cluster.events.wait_training, 1, t0, 120)
        tree = process_tree(hooks.torchrun.pid) + process_tree(hooks.torchrun.pool.pid)
        assert len(tree) >= 3  # launcher, pool, forked torchrun and worker
        await hooks.on_leave(LeaveCommand(instance_id="i-hooks", reason="removed from the rendezvous"))
        await asyncio.wait_for(runner, 30)
        assert psutil.wait_procs(tree, timeout=10)[1] == []
        assert states == ["training"]
        assert [(type(e), e.reason) for e in events] == [(TrainerExited, "stopped")]
        assert StoreLink(cluster.host, cluster.port, "hooks").connect().has_left("127.0.0.2")


@pytest.mark.parametrize("when", ["before run", "while run probes the store"])
async def test_a_node_noticed_before_torchrun_starts_never_trains_and_says_it_is_leaving(tmp_path, when):
    """A replacement noticed while it restores can get its notice before its first torchrun: in a
    loaded storm run such a node started torchrun 5 s after its notice, trained alone past the
    wave and lost what it trained. The hooks must not start torchrun once drained, and must tell
    fleetd the node is leaving (its status), so that it is ended rather than kept."""
    import asyncio
    from datetime import UTC, datetime, timedelta

    from fleetd.protocol.messages import Notice

    async with _hooks_beside_a_store(tmp_path, "early", "i-early") as (hooks, _, events, states):
        notice = Notice(
            instance_id="i-early", action="terminate", action_time=datetime.now(UTC) + timedelta(seconds=120)
        )
        if when == "before run":
            await hooks.on_notice(notice)
            runner = asyncio.create_task(hooks.run())
        else:
            runner = asyncio.create_task(hooks.run())
            await asyncio.sleep(0)  # run() is now awaiting its first store probe (a worker thread)
            await hooks.on_notice(notice)
        await asyncio.wait_for(runner, 30)
        assert hooks.torchrun is None and hooks.starts == 0
        assert states == ["draining", "leaving"] and events == []
        assert not (tmp_path / "torchrun.log").exists() or "torchrun" not in (tmp_path / "torchrun.log").read_text()


@pytest.mark.slow
async def test_a_bug_in_the_job_ends_torchruns_restarts_and_is_reported_failed(tmp_path):
    """torchrun would restart a worker group that fails on the job's own bug up to its
    --max-restarts (100), each attempt from the last checkpoint, while the node bills. The agent
    reads torchrun's log, sees a failure with no network fault in it, ends torchrun and reports
    the exit as failed (fleetd decides on a restart: fleetd/policy/job_state.py)."""
    import asyncio

    from fleetd.protocol.messages import TrainerExited

    args = ("--steps", "100000", "--fail-at-step", "5")
    async with _hooks_beside_a_store(tmp_path, "bug", "i-bug", train_args=args) as (hooks, _, events, states):
        assert hooks.spec.max_restarts >= 100  # torchrun alone would retry it that often
        runner = asyncio.create_task(hooks.run())
        for _ in range(1200):  # virtual-time free: the exit comes from a real torchrun
            if events:
                break
            await asyncio.sleep(0.1)
        assert [(type(e), e.reason, e.exit_code) for e in events] == [(TrainerExited, "failed", 1)], events
        log = (tmp_path / "torchrun.log").read_text(errors="replace")
        assert "the job's code failed at step 5" in log
        # Ended at its first or second failure line, not after a hundred restarts.
        assert log.count("failed (exitcode:") <= 2, log[-3000:]
        # The agent waits for fleetd's word (restart-trainer), it does not crash-loop on its own.
        await asyncio.sleep(1.0)
        assert states[-1] == "ready" and not runner.done() and hooks.starts == 1
        await hooks.stop()
        await asyncio.wait_for(runner, 30)


def test_a_workers_exit_wakes_the_pool_at_once(tmp_path):
    """The pool watches each worker's pidfd beside its listener: an exit makes the loop's select
    ready, so the launcher (and torchrun) hear of it without waiting out the loop's 50 ms turn."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "pool.sock"))
    listener.listen()
    pool = _Pool(listener)
    pool.sel.register(listener, selectors.EVENT_READ)
    worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pool._watch_exit(worker.pid)
        assert pool.sel.select(timeout=0) == []  # running: nothing to do
        assert worker.stdin is not None
        worker.stdin.close()  # the worker ends
        ready = pool.sel.select(timeout=60)
        assert [key.fd for key, _ in ready] == [pool.pidfds[worker.pid]]
    finally:
        worker.wait(timeout=60)
        for pidfd in pool.pidfds.values():
            os.close(pidfd)
        pool.sel.close()
        listener.close()
