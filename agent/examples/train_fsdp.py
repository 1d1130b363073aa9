"""FSDP (``fully_shard``) with fleetd's checkpoint helper in DCP mode: every rank saves and loads
only its shard (torch.distributed.checkpoint), and the agent publishes a step once the shards of
all nodes are in S3 (the step's ``.metadata`` names every file).

    torchrun --nproc-per-node=2 -m agent.examples.train_fsdp --steps 100

The fleetd lines are the same as for a plain loop, with ``mode="dcp"``. A node lost without notice
takes its shard with it: sharded state rolls back to the last checkpoint every node holds (or the
last durable one), so keep ``checkpoints.interval_steps`` short; a notice still loses no steps.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from agent.trainer import ElasticCheckpointer, TrainerContext

    torch.set_num_threads(1)
    ctx = TrainerContext.from_env()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ElasticCheckpointer(model, optimizer, mode="dcp", ctx=ctx)
    step = ckpt.resume()
    ckpt.emit("start", from_step=step, restart_count=ctx.restart_count)
    gen = torch.Generator().manual_seed(1234 + ctx.rank)
    while step < args.steps:
        step += 1
        x = torch.randn(16, 32, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x.sum(dim=1, keepdim=True)))
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        optimizer.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.emit("step", step=step, loss=round(float(loss.detach()), 6))
        ckpt.step_done(step)
    ckpt.save(step)
    ckpt.emit("done", step=step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from agent.trainer.worker_exit import run_worker

    run_worker(main)  # sys.exit(main()) without the interpreter's teardown, which can abort
