"""A small regression MLP that trains on CPU (gloo) in a fraction of a second per step, or on a
GPU (``--device cuda``: NCCL when every rank has a GPU of its own, gloo when ranks share one).

Run under torchrun (what fleetd's supervisor does) or alone:
``python -m agent.examples.toy_job.train_toy --steps 100``. It uses fleetd's checkpoint helper, so it
resumes where the job left off after a membership change, and keeps the global batch constant
whatever the world size.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000, help="total steps of the job")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.05,
        help="extra seconds per step, standing in for real work (keeps CPU use low)",
    )
    p.add_argument("--mode", choices=("state_dict", "dcp"), default="state_dict")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=int(os.environ.get("FLEETD_TOY_FAIL_AT_STEP", "0") or 0),
        help="raise at this step (and after it) on every rank, as a bug in a job would (0: never); shows how "
        "fleetd retries a failing job a bounded number of times, then fails it",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: gloo on CPU; on CUDA nccl, or gloo when the node's ranks outnumber its GPUs "
        "(NCCL refuses two ranks on one GPU)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t_main = time.time()
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn

    from agent.trainer import ElasticCheckpointer, TrainerContext, loss_weight, rank_indices

    torch.set_num_threads(1)  # many ranks share few cores; oversubscription only slows them
    ctx = TrainerContext.from_env()
    device = _device(args.device, ctx.local_rank)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(_backend(args.backend, device, ctx.local_world_size))
    t_group, cpu_group = time.time(), time.process_time()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    x, y = _dataset(args.dim, device)
    n = x.shape[0]

    model = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt = ElasticCheckpointer(model, optimizer, mode=args.mode, ctx=ctx)
    step = ckpt.resume()
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids) if dist.is_initialized() else model
    ckpt.emit(
        "start",
        from_step=step,
        restart_count=ctx.restart_count,
        t_main=t_main,
        t_group=t_group,
        cpu_group=cpu_group,
        cpu=time.process_time(),
        device=str(device),
        backend=dist.get_backend() if dist.is_initialized() else None,
    )

    # What a job prints reaches journald on the node and `fleetd logs` on the control host
    # (agent/supervise/worker_output.py); flushed, since stdout is a pipe, not a terminal.
    print(f"train_toy: rank {ctx.rank} of {ctx.world_size} starts at step {step} on {device}", flush=True)

    pace_s = _pace_s(ctx.world_size)

    # A peer lost without notice breaks (or hangs) a collective: save the completed step first.
    with ckpt.salvage_on_failure():
        while step < args.steps:
            began = time.monotonic()
            step += 1
            idx = rank_indices(step, args.global_batch, n, ctx.rank, ctx.world_size, args.seed)
            weight = loss_weight(args.global_batch, ctx.rank, ctx.world_size)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(x[idx]), y[idx]) * weight
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            optimizer.step()
            if pace_s:
                time.sleep(max(0.0, pace_s - (time.monotonic() - began)))
            elif args.step_sleep:
                time.sleep(args.step_sleep)
            if args.fail_at_step and step >= args.fail_at_step:  # every attempt: a bug, not a glitch
                raise RuntimeError(f"the job's code failed at step {step} (--fail-at-step)")
            ckpt.emit("step", step=step, loss=round(float(loss.detach()) / weight, 6))
            if step % 100 == 0 and ctx.rank == 0:
                print(f"train_toy: step {step} loss {float(loss.detach()) / weight:.6f}", flush=True)
            ckpt.step_done(step)

    ckpt.save(step)
    ckpt.emit("done", step=step)
    print(f"train_toy: rank {ctx.rank} done at step {step}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _dataset(dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem (the same on every rank and every restart)."""
    import torch

    data_gen = torch.Generator().manual_seed(1234)
    n = 4096
    x = torch.randn(n, dim, generator=data_gen)
    true_w = torch.randn(dim, 1, generator=data_gen)
    y = torch.tanh(x @ true_w) + 0.01 * torch.randn(n, 1, generator=data_gen)
    return x.to(device), y.to(device)


def _pace_s(world_size: int) -> float:
    """Optional scaling curve (fleetd demo --scenario scaling): one step's work of work_s seconds
    is shared by up to saturate_at nodes, so the job's steps/s grows with each node up to that
    size and not beyond, the shape a job capped by its input pipeline or all-reduce has. Steps
    are paced to that duration (not slept on top of the compute), so the curve holds on a busy
    host where splitting the toy's own compute over more ranks would otherwise still pay."""
    work_s = float(os.environ.get("FLEETD_TOY_WORK_S", "0") or 0)
    saturate_at = max(1, int(os.environ.get("FLEETD_TOY_SATURATE_AT", "1") or 1))
    return work_s / min(world_size, saturate_at) if work_s > 0 else 0.0


def _device(kind: str, local_rank: int) -> torch.device:  # torch is imported late
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _backend(choice: str, device: torch.device, local_world_size: int) -> str:
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "gloo"
    import torch

    return "nccl" if local_world_size <= torch.cuda.device_count() else "gloo"


if __name__ == "__main__":
    from agent.trainer.worker_exit import run_worker

    run_worker(main)  # sys.exit(main()) without the interpreter's teardown, which can abort
