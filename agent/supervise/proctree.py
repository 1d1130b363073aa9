"""A process tree, found before anything is signalled, and signalled group by group.

torchrun runs in its own session, and torch starts each worker in yet another session, so "the
process tree" is found by walking descendants (psutil) *before* anything is killed; then every
process group in it is killed.
"""

from __future__ import annotations

import os
import signal

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every descendant, found before anything is signalled."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(procs: list[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Signal every process group in the tree, then every process (groups catch grandchildren
    started after the walk; direct signals catch processes that left their group)."""
    groups: set[int] = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            continue
    own = os.getpgid(0)
    for g in groups - {own}:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def kill_by_env(key: str, value: str, rounds: int = 3, wait_s: float = 2.0) -> int:
    """SIGKILL every process whose environment holds ``key=value``; returns how many were found.

    For what a tree walk cannot see: torch starts each worker in a new session, so one started
    after the walk (torchrun restarting a failed worker while its parent is being stopped) is in
    no group the walk found and is orphaned when torchrun dies. systemd's cgroup catches it on a
    real node; a local node has only the environment its processes inherited. Blocking."""
    found_total = 0
    for _ in range(rounds):
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(key) == value:
                    found.append(p)
            except psutil.Error:
                continue
        if not found:
            break
        found_total += len(found)
        kill_tree(found, signal.SIGKILL)
        psutil.wait_procs(found, timeout=wait_s)
    return found_total
