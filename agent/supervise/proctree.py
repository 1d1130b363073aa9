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
