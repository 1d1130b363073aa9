"""fleetd for the Hugging Face ``Trainer`` (``pip install fleetd[hf]``): one callback.

    fleetd = FleetdCallback()  # from agent.trainer.integrations.hf import FleetdCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[fleetd])
    with fleetd.salvage_on_failure():   # optional: a peer's broken collective raised
        trainer.train()

Set ``max_steps`` and ``save_strategy="no"``: fleetd saves model, optimizer and LR scheduler in
its own directory. (docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import TrainerCallback

from agent.trainer.context import TrainerContext
from agent.trainer.integrations.core import FrameworkSession
from agent.trainer.local_ckpt import Mode


class FleetdCallback(TrainerCallback):
    def __init__(self, *, mode: Mode = "state_dict", ctx: TrainerContext | None = None) -> None:
        self.session = FrameworkSession(mode=mode, ctx=ctx)
        self._finished = False

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> Any:
        stateful = {"lr_scheduler": lr_scheduler} if lr_scheduler is not None else {}
        step = self.session.begin(model, optimizer, stateful)
        # Resumed from the newest step any rank holds (a newcomer's from a peer, a fresh cluster's
        # from S3): the Trainer runs the steps that remain. Not the data position: the Trainer
        # chose where its dataloader starts before any callback ran, so a new pass over the data
        # begins (as it does anyway when the world size, and so the sharding, changes).
        if step:
            state.global_step = step
            if state.max_steps and step >= state.max_steps:
                # The job was done. The Trainer checks this flag only after a step, so one more
                # step runs in memory; it is neither reported nor saved.
                control.should_training_stop = True
                self._finished = True
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self._finished:
            self.session.step_done(state.global_step)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.session.end(None if self._finished else state.global_step)
        return control

    @contextmanager
    def salvage_on_failure(self) -> Iterator[None]:
        with self.session.salvage_on_failure():
            yield
