"""Resume: which step the job continues from, and how each rank gets its state (the
``ElasticCheckpointer``'s start-up half; ``agent/trainer/elastic.py`` holds the per-step half).

A mixin over the checkpointer's own state (``ctx``, ``root``, ``mode``, ``model``, ``optimizer``,
its collectives and ``emit``), kept apart because it is a job of its own: local copies first, a
peer's copy over the process group next, S3 last, unless S3 holds a newer durable step than any
rank (then S3 first).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from agent.trainer import local_ckpt
from agent.trainer.context import TrainerContext
from agent.trainer.local_ckpt import Mode

if TYPE_CHECKING:
    from agent.trainer.store_link import StoreLink

NONE = -1  # "no step": a rank holds no complete checkpoint
# How long a world waits for a newer step a survivor outside it salvaged to reach S3 (its agent
# uploads it on the salvage; seconds for a small model, ~1 s per GB at S3's usual per-node rate).
SALVAGE_AWAIT_S = 30.0
SALVAGE_POLL_S = 1.0


def salvage_await_s() -> float:
    return float(os.environ.get("FLEETD_SALVAGE_AWAIT_S", SALVAGE_AWAIT_S))


def collective_device(dist: Any) -> Any:
    """Where the checkpointer's own collectives keep their tensors: the current GPU under a
    NCCL-only process group (NCCL has no CPU tensors: "No backend type associated with device
    type cpu"), host memory under gloo or a group with a backend for each device."""
    import torch

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ResumeSteps:
    ctx: TrainerContext
    root: Any
    mode: Mode
    model: Any
    optimizer: Any
    resumed_from: int | None
    last_saved: int | None
    _guard: Any
    _link: StoreLink | None  # the steered run's link to the store (None: not steered)

    # The checkpointer's collectives and reporting (agent/trainer/elastic.py defines them).
    def _all_reduce(self, value: int, op: str) -> int:
        raise NotImplementedError

    def _agree_max(self, value: int) -> int:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError

    def _apply_plain(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def emit(self, event: str, **fields: Any) -> None:
        raise NotImplementedError

    def resume(self) -> int:
        """Load the newest checkpoint every rank can use; return its step (0: fresh start).

        Local copies first: the newest step any rank holds wins. Replicated state a rank lacks
        (a newcomer) comes from a peer over the process group, which is faster than S3. S3 is read
        when no rank has a local copy (a fresh or fully replaced cluster), or for sharded state a
        node's local directory cannot complete.
        """
        newest = self._agree_max(self._newest_local())
        # A newer durable step in S3 beats every local copy: a node that dropped out of the world
        # (a slow restart) while the others trained on and then all left holds only a stale copy,
        # and resuming from it lost every step since (108 in a demo wave). One GET of ``latest``,
        # by rank 0 for the whole world (the MAX gives every rank its answer): one per node cost
        # every node a botocore client, ~0.1-0.3 s of CPU, on every re-form, and N GETs at N nodes.
        durable = self._agree_max(self._newest_durable() if self.ctx.rank == 0 else NONE)
        if self.ctx.steered and self.ctx.s3_bucket:
            # A survivor that is not in this world (still restarting) may hold a newer salvaged
            # step: resuming from an older one would train steps again (a worker kill, chaos).
            awaited = self._await_salvaged(max(newest, durable)) if self.ctx.rank == 0 else NONE
            durable = max(durable, self._agree_max(awaited))
        if newest == NONE or durable > newest:
            if self.ctx.local_rank == 0:
                self._restore_from_s3()
            self._barrier()
            newest = self._agree_max(self._newest_local())
        step = 0
        if newest != NONE:
            if not self._everyone_has(newest) and self.mode == "dcp":
                if self.ctx.local_rank == 0 and not self._has(newest):
                    self._restore_from_s3()
                self._barrier()
            if self._everyone_has(newest):
                self._load_local(newest)
                step = newest
            elif self.mode == "state_dict":
                step = self._load_from_peer(newest, self._has(newest))
            else:
                # Sharded state cannot come from one peer: fall back to what every rank holds.
                step = self._all_reduce(self._newest_local(), "MIN")
                if step == NONE:
                    step = 0
                else:
                    self._load_local(step)
        self.resumed_from = step
        self.last_saved = step if step else None
        if self._guard is not None:
            self._guard.step_done(step)
        self.emit("resumed", from_step=step)
        return step

    def _await_salvaged(self, have: int) -> int:
        """Rank 0: when the store names a salvaged step newer than ``have`` (every rank's newest and
        S3's), wait up to ``salvage_await_s`` for its node's agent to make it durable; the durable
        step then (NONE: nothing newer). Past the wait it is given up, in the store too, so the
        next world does not wait for it again."""
        from agent.trainer.store_link import StoreLinkError

        link = self._link
        if link is None:
            return NONE
        try:
            seen = link.salvaged()
        except StoreLinkError:
            return NONE
        if seen is None or seen.step <= have:
            return NONE
        self.emit("awaiting_salvage", step=seen.step, node=seen.addr, have=have)
        started = time.monotonic()
        while True:
            durable = self._newest_durable()
            if durable >= seen.step:
                self.emit("salvage_durable", step=durable, waited_s=round(time.monotonic() - started, 2))
                return durable
            if time.monotonic() - started >= salvage_await_s():
                break
            time.sleep(SALVAGE_POLL_S)
        self.emit("salvage_unreachable", step=seen.step, node=seen.addr, resuming_below=have)
        try:
            link.give_up_salvage(seen, max(have, 0))
        except StoreLinkError:
            pass
        return durable

    def _newest_local(self) -> int:
        mine = local_ckpt.newest_complete(self.root, self.mode)
        return NONE if mine is None else mine

    def _has(self, step: int) -> bool:
        return local_ckpt.is_complete(local_ckpt.step_dir(self.root, step), self.mode)

    def _everyone_has(self, step: int) -> bool:
        return self._all_reduce(1 if self._has(step) else 0, "MIN") == 1

    def _load_local(self, step: int) -> None:
        if self.mode == "state_dict":
            self._apply_plain(local_ckpt.load_plain(self.root, step))
            return
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer if self.optimizer is not None else [])
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        load(sd, storage_reader=FileSystemReader(str(local_ckpt.step_dir(self.root, step))))
        set_state_dict(
            self.model,
            self.optimizer if self.optimizer is not None else [],
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
        )

    def _load_from_peer(self, step: int, have: bool) -> int:
        """Replicated state: the lowest rank holding ``step`` sends it to everyone (a newcomer
        with no S3 copy still starts at the survivors' step)."""
        import ctypes
        import io

        import torch
        import torch.distributed as dist

        src = self._all_reduce(self.ctx.rank if have else 1 << 30, "MIN")
        # broadcast_object_list needs numpy; a byte tensor does not.
        blob = b""
        if self.ctx.rank == src:
            blob = (local_ckpt.step_dir(self.root, step) / local_ckpt.PLAIN_FILE).read_bytes()
        size = self._all_reduce(len(blob), "MAX")
        buf = torch.zeros(size, dtype=torch.uint8, device=collective_device(dist))
        if self.ctx.rank == src:
            buf[:] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        dist.broadcast(buf, src=src)
        host = buf.cpu()  # a GPU buffer's pointer is no host address
        raw = ctypes.string_at(host.data_ptr(), size)  # the tensor's bytes, without numpy
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        self._apply_plain(state["state"])
        self.emit("state_from_peer", step=step, src=src, nbytes=size)
        return step

    def _newest_durable(self) -> int:
        """The step S3's ``latest`` pointer names (NONE: no S3, no pointer, or S3 unreachable)."""
        bucket = self.ctx.s3_bucket
        if not bucket:
            return NONE
        import asyncio

        from agent.checkpoint_store.store import CheckpointStore
        from fleetd.shared.settings import AwsConfig, CheckpointConfig

        async def fetch() -> int:
            cfg = CheckpointConfig(bucket=bucket, prefix=self.ctx.s3_prefix, local_dir=self.root)
            aws = AwsConfig(region=self.ctx.s3_region, endpoint_url=self.ctx.s3_endpoint)
            async with CheckpointStore.connect(cfg, aws, job=self.ctx.job) as store:
                pointer, _ = await store.publisher.read_latest()
                return NONE if pointer is None else pointer.step

        try:
            return asyncio.run(fetch())
        except Exception as exc:  # noqa: BLE001 - a failed look at S3 must never stop training
            self.emit("latest_unreadable", error=f"{type(exc).__name__}: {exc}"[:200])
            return NONE

    def _restore_from_s3(self) -> int | None:
        """Newest durable checkpoint from S3 into the local directory (agent/checkpoint_store)."""
        bucket = self.ctx.s3_bucket
        if not bucket:
            return None
        import asyncio

        from agent.checkpoint_store.errors import StoreError
        from agent.checkpoint_store.store import CheckpointStore
        from fleetd.shared.settings import AwsConfig, CheckpointConfig

        async def fetch() -> int | None:
            cfg = CheckpointConfig(bucket=bucket, prefix=self.ctx.s3_prefix, local_dir=self.root)
            aws = AwsConfig(region=self.ctx.s3_region, endpoint_url=self.ctx.s3_endpoint)
            async with CheckpointStore.connect(cfg, aws, job=self.ctx.job) as store:
                restored = await store.restore_latest(self.root)
                return None if restored is None else restored.step

        started = time.monotonic()
        try:
            step = asyncio.run(fetch())
        except (StoreError, OSError) as exc:
            self.emit("restore_failed", error=str(exc))
            return None
        if step is not None and self.mode == "state_dict":
            d = local_ckpt.step_dir(self.root, step)
            if (d / local_ckpt.PLAIN_FILE).is_file() and not (d / local_ckpt.MARKER).is_file():
                (d / local_ckpt.MARKER).write_text(json.dumps({"step": step, "mode": self.mode, "restored": True}))
        self.emit("restored", step=step, duration_s=round(time.monotonic() - started, 3))
        return step
