"""fleetd for the Lightning ``Trainer`` (``pip install fleetd[lightning]``): one callback.

    from agent.trainer.integrations.lightning import FleetdCallback

    trainer = L.Trainer(max_steps=..., callbacks=[FleetdCallback()], enable_checkpointing=False,
                        accelerator=..., devices=local_world_size, num_nodes=world // local_world_size)
    trainer.fit(module, dataloader)

On start the callback resumes from the newest step any rank holds (a newcomer gets it from a peer,
a fresh cluster from S3): module, optimizer and LR schedulers, and the loop's step counter, so
``max_steps`` counts the whole job. After every optimizer step it answers fleetd's checkpoint
requests at one agreed step and holds while a node leaves; a failure (``on_exception``) or
torchrun's SIGTERM while a collective hangs saves the completed step first. Lightning's own SIGTERM
handler is replaced while training: it broadcasts inside the handler, which hangs with the very
peer whose loss sent the signal.

Not restored: the data position (a resumed run starts a new pass over its dataloader) and loop
state beyond the step count. One optimizer (automatic or manual optimization).
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
        if len(trainer.optimizers) != 1:
            raise ValueError(f"fleetd's Lightning callback supports one optimizer, not {len(trainer.optimizers)}")
        stateful = {f"lr_scheduler_{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)}
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
