"""What every framework callback does, over the same core as a plain loop (``ElasticCheckpointer``).

A framework owns the training loop, so its callback cannot wrap it as a plain script does. The
framework says when training begins, when an optimizer step completed and when training ends or
fails; ``FrameworkSession`` turns those into the checkpointer's calls: resume and arm the SIGTERM
watcher, ``step_done``, a salvage, a last save.
(docs/DESIGN.md "Training loops and what each guarantees")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from agent.trainer.context import TrainerContext
from agent.trainer.elastic import ElasticCheckpointer
from agent.trainer.local_ckpt import Mode
from agent.trainer.salvage import TermWatcher


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): its step hooks are what tell a salvage which step the
    parameters hold, and the wrapper's own ``step`` does not fire them."""
    for _ in range(4):  # wrappers of wrappers, but never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


class FrameworkSession:
    """One training run's link to fleetd, driven by a framework callback."""

    def __init__(self, *, mode: Mode = "state_dict", ctx: TrainerContext | None = None) -> None:
        self.mode: Mode = mode
        self.ctx = ctx
        self.ckpt: ElasticCheckpointer | None = None
        self.step = 0
        self._watcher: TermWatcher | None = None

    def begin(
        self, model: Any, optimizer: Any, stateful: dict[str, Any] | None = None, *, take_over_sigterm: bool = False
    ) -> int:
        """Call on every rank once the process group exists; returns the step to continue from."""
        self.ckpt = ElasticCheckpointer(
            model, torch_optimizer(optimizer), mode=self.mode, ctx=self.ctx, stateful=stateful
        )
        self.step = self.ckpt.resume()
        # Saves the completed step when a peer vanishes and torchrun stops this worker mid-collective.
        self._watcher = TermWatcher(self.ckpt.salvage_before_exit)
        why_not = self._watcher.arm(take_over=take_over_sigterm)
        if why_not is not None:
            self.ckpt.emit("salvage_on_sigterm_off", why=why_not)
            self._watcher = None
        ctx = self.ckpt.ctx
        self.ckpt.emit("start", from_step=self.step, restart_count=ctx.restart_count)
        return self.step

    def updates_start_after_the_closure(self) -> None:
        """The framework runs forward and backward inside ``optimizer.step(closure)``; it will call
        ``about_to_update()`` right before the parameters change (salvage.UpdateGuard)."""
        guard = self.ckpt.update_guard if self.ckpt is not None else None
        if guard is not None:
            guard.update_starts_explicitly()

    def about_to_update(self) -> None:
        guard = self.ckpt.update_guard if self.ckpt is not None else None
        if guard is not None:
            guard.about_to_update()

    def step_done(self, step: int, **fields: Any) -> None:
        """Call on every rank after each optimizer step (``step`` counts completed steps)."""
        if self.ckpt is None or step <= self.step:
            return  # gradient accumulation: the framework calls per batch, a step is an update
        self.step = step
        self.ckpt.emit("step", step=step, **fields)
        self.ckpt.step_done(step)

    def failed(self, exc: BaseException) -> None:
        """The loop raised (a peer's collective broke): save the completed step if it is known."""
        if self.ckpt is None:
            return
        try:
            self.ckpt.salvage(f"{type(exc).__name__}: {exc}"[:200])
        except Exception as salvage_exc:  # noqa: BLE001 - never hide the training failure
            self.ckpt.emit("salvage_failed", error=repr(salvage_exc)[:200])
        finally:
            self._disarm()

    def end(self, step: int | None) -> None:
        """Training finished on every rank: save its last step (collective; None: nothing new), so
        a job restarted after it finished does not train again."""
        self._disarm()
        if self.ckpt is None:
            return
        if step is not None:
            self.ckpt.save(step)
        self.ckpt.emit("done", step=self.step if step is None else step)

    @contextlib.contextmanager
    def salvage_on_failure(self) -> Iterator[None]:
        """Around a framework's ``train()``/``fit()`` whose callbacks hear nothing of a failure."""
        try:
            yield
        except Exception as exc:
            self.failed(exc)
            raise

    def _disarm(self) -> None:
        if self._watcher is not None:
            self._watcher.disarm()
            self._watcher = None
