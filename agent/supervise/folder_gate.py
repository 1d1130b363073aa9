"""Folder mode: every node starts a round's workers on the same checkpoint version.

A script that imports nothing from fleetd loads whatever its folder holds, and a late joiner's
newest *durable* version can be older than the survivors' last save (measured: epoch 6 against 7,
``fleetd demo --job`` with notices, 2026-11-27). So torchrun (agent/supervise/torchrun_main.py)
runs ``gate`` on every node after each rendezvous round, before it starts the round's workers.
(docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agent.supervise.folder_watch import scan

GATE_ENV = "FLEETD_FOLDER_GATE"
SCHEMA_VERSION: Literal[1] = 1
_POLL_S = 0.1


class FolderState(BaseModel):
    """What the agent last put in S3 or took from it for this folder (agent -> torchrun)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Literal[1] = SCHEMA_VERSION
    version: int = 0  # 0: none (an empty folder, or files of unknown origin)
    fingerprint: str = ""  # the version's content (names, sizes, checksums); "" unknown
    files: dict[str, tuple[int, int]] = {}  # the folder's scan when it held that version


class FolderWant(BaseModel):
    """torchrun -> agent: put a version at least this new in the folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Literal[1] = SCHEMA_VERSION
    at_least: int


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    folder: Path
    state: Path
    want: Path
    timeout_s: float = 60.0


def fingerprint(files: Iterable[Any]) -> str:
    """A version's content from its manifest entries (name, size, checksum), whoever uploaded it."""
    text = "\n".join(sorted(f"{f.name}\t{f.size}\t{f.checksum}" for f in files))
    return hashlib.sha256(text.encode()).hexdigest()


def write_model(path: Path, model: BaseModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(model.model_dump_json())
    os.replace(tmp, path)


def read_state(path: Path) -> FolderState | None:
    try:
        return FolderState.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None


def read_want(path: Path) -> FolderWant | None:
    try:
        return FolderWant.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None


@dataclass(frozen=True, slots=True)
class Held:
    version: int
    fingerprint: str


def version_to_take(mine: Held, everyone: Iterable[Held]) -> int | None:
    """The version this node must take before its workers start; None: its folder is current."""
    newest = max(everyone, key=lambda h: h.version, default=mine)
    if newest.version <= mine.version:
        return None
    if mine.fingerprint and mine.fingerprint == newest.fingerprint:
        return None  # the same save, uploaded by another node under another number
    return newest.version


def _clean(cfg: GateConfig) -> FolderState | None:
    """The folder's state once it holds what the agent last uploaded or restored; None while not.
    No state file at all: no agent syncs this folder (no checkpoint store), nothing to wait for."""
    state = read_state(cfg.state)
    files = scan(cfg.folder)
    if state is None:
        return FolderState(files=files)
    return state if dict(state.files) == files else None


def _until(deadline: float, probe: Callable[[], Any]) -> Any:
    while True:
        found = probe()
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


def gate(store: Any, group_rank: int, world: int, cfg: GateConfig) -> str:
    """1. wait until the folder is clean: it holds what the agent last uploaded or restored (the
       workers are stopped, so it settles and is uploaded within ``settle_s`` and an upload);
    2. publish (version, fingerprint) under the round's store prefix, one key per node;
    3. read every node's; the highest version number is the newest (as for ``restore_latest``);
    4. if that is not what the folder holds, ask the agent for it (``want``) and wait for it.
    All within ``timeout_s``, then the workers start with what the folder holds. Returns a line
    saying what happened (torchrun's stderr, the node's log)."""
    deadline = time.monotonic() + cfg.timeout_s
    state = _until(deadline, lambda: _clean(cfg))
    mine = Held(state.version, state.fingerprint) if state is not None else Held(0, "")
    store.set(f"fleetd.folder.{group_rank}", json.dumps([mine.version, mine.fingerprint]))
    keys = [f"fleetd.folder.{r}" for r in range(world)]
    _until(deadline, lambda: True if store.check(keys) else None)
    everyone = [Held(*json.loads(store.get(k))) for k in keys if store.check([k])]
    missing = world - len(everyone)
    take = version_to_take(mine, everyone)
    if take is None:
        return f"fleetd: folder at version {mine.version}, the newest of {len(everyone)} node(s); {missing} silent"
    write_model(cfg.want, FolderWant(at_least=take))
    got = _until(deadline, lambda: s if (s := _clean(cfg)) is not None and s.version >= take else None)
    if got is None:
        return f"fleetd: folder version {take} not fetched in {cfg.timeout_s:g} s; starting on {mine.version}"
    return f"fleetd: folder moved from version {mine.version} to {got.version} (the newest in the world)"


def install(raw: str) -> bool:
    """Run ``gate`` before torchrun starts each round's workers. False (said on stderr) when
    torch's agent no longer looks as expected: the workers then start ungated, as before."""
    try:
        cfg = GateConfig.model_validate_json(raw)
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        original = LocalElasticAgent._start_workers
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"fleetd: folder gate off: {exc}", file=sys.stderr)
        return False

    def _start_workers(self: Any, worker_group: Any) -> Any:
        try:
            line = gate(worker_group.store, worker_group.group_rank, worker_group.group_world_size, cfg)
        except Exception as exc:  # noqa: BLE001 - the workers start anyway; the node's log says why
            line = f"fleetd: folder gate failed: {exc!r}"
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(FileNotFoundError):
            cfg.want.unlink()
        return original(self, worker_group)

    LocalElasticAgent._start_workers = _start_workers  # type: ignore[method-assign]
    return True
