"""A Lightning ``Trainer`` job with fleetd's callback: a small regression MLP on CPU (gloo) under
torchrun.

    python -m agent.examples.train_lightning --steps 200     # alone, or under fleetd's torchrun

The only fleetd line is ``callbacks=[FleetdCallback()]``. ``devices`` and ``num_nodes`` come from
torchrun's environment (the world size changes as nodes come and go); the per-device batch is the
global batch divided by the world size.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000, help="max_steps of the job")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.05,
        help="extra seconds per step, standing in for real work (keeps CPU use low)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from agent.trainer.integrations.lightning import FleetdCallback

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    L.seed_everything(args.seed, verbose=False)

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, args.dim, generator=gen)
    y = torch.tanh(x @ torch.randn(args.dim, 1, generator=gen))

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(args.dim, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            if args.step_sleep:
                time.sleep(args.step_sleep)
            return nn.functional.mse_loss(self.net(xb), yb)

        def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, 100, 0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    loader = DataLoader(TensorDataset(x, y), batch_size=max(1, args.global_batch // world), shuffle=True)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=local_world,
        num_nodes=max(1, world // local_world),
        strategy="ddp" if world > 1 else "auto",
        callbacks=[FleetdCallback()],
        enable_checkpointing=False,  # fleetd checkpoints
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), loader)
    return 0


if __name__ == "__main__":
    from agent.trainer.worker_exit import run_worker

    run_worker(main)  # sys.exit(main()) without the interpreter's teardown, which can abort
