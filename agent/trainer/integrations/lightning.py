"""fleetd for the Lightning ``Trainer`` (``pip install fleetd[lightning]``): one callback.

    trainer = L.Trainer(max_steps=..., callbacks=[FleetdCallback()], enable_checkpointing=False,
                        devices=local_world_size, num_nodes=world // local_world_size, ...)
    trainer.fit(module, dataloader)

Restored: module, optimizer, LR schedulers and the step count (``max_steps`` counts the whole job);
not the data position nor other loop state. (docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from agent.trainer.context import TrainerContext
from agent.trainer.integrations.core import FrameworkSession
from agent.trainer.local_ckpt import Mode


class FleetdCallback(Callback):
    def __init__(self, *, mode: Mode = "state_dict", ctx: TrainerContext | None = None) -> None:
        self.session = FrameworkSession(mode=mode, ctx=ctx)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:  # one optimizer, with automatic or manual optimization
            raise ValueError(f"fleetd's Lightning callback supports one optimizer, not {len(trainer.optimizers)}")
        stateful = {f"lr_scheduler_{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)}
        # Lightning's SIGTERM handler broadcasts, which hangs with the very peer whose loss sent the
        # signal: the session's watcher takes SIGTERM over while training.
        step = self.session.begin(pl_module, trainer.optimizers[0], stateful, take_over_sigterm=True)
        if pl_module.automatic_optimization:
            self.session.updates_start_after_the_closure()
        if step:
            _set_global_step(trainer, step)
            if trainer.max_steps and 0 < trainer.max_steps <= step:
                trainer.should_stop = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # After the closure's forward and backward, right before the parameters change.
        self.session.about_to_update()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.session.step_done(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.end(trainer.global_step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.failed(exception)


def _set_global_step(trainer: Any, step: int) -> None:
    """Lightning's ``global_step`` is the count of completed optimizer steps in its progress
    tracking (what its own checkpoint restores); ``max_steps`` and step-based logging read it."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step
    else:
        progress = loop.manual_optimization.optim_step_progress
    progress.total.ready = progress.total.completed = step
    loop._batches_that_stepped = step
