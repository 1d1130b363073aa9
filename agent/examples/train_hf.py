"""A Hugging Face ``Trainer`` job with fleetd's callback: a tiny GPT-2 built from a config (no
download) learning a synthetic sequence task on CPU (gloo) under torchrun.

    python -m agent.examples.train_hf --steps 200            # alone, or under fleetd's torchrun

The only fleetd lines are the callback (``callbacks=[fleetd]``) and, optionally, the
``salvage_on_failure()`` around ``train()``. ``max_steps`` is the job's length; the Trainer's own
checkpoints stay off (fleetd saves at its agreed step). The per-device batch is the global batch
divided by the world size, so the global batch stays the same when nodes come and go.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=1000, help="max_steps of the job")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.05,
        help="extra seconds per step, standing in for real work (keeps CPU use low)",
    )
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank (NCCL)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from agent.trainer.integrations.hf import FleetdCallback

    torch.set_num_threads(1)  # many ranks share few cores
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=64, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)

    # Synthetic data: counting sequences modulo the vocabulary, from random starts (learnable).
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, config.vocab_size, (4096,), generator=gen)
    seqs = (starts[:, None] + torch.arange(args.seq_len)[None, :]) % config.vocab_size
    dataset = [{"input_ids": s, "labels": s} for s in seqs]

    class Pace(TrainerCallback):  # stands in for a bigger model's step time
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            time.sleep(args.step_sleep)

    out = args.output_dir or tempfile.mkdtemp(prefix="fleetd-hf-")
    training = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=max(1, args.global_batch // world),
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=10,
        save_strategy="no",  # fleetd checkpoints (agreed step on a notice, periodic, salvage)
        report_to="none",
        logging_steps=50,
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        ddp_backend="gloo" if world > 1 and args.device == "cpu" else None,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    fleetd = FleetdCallback()
    trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[fleetd, Pace()])
    with fleetd.salvage_on_failure():
        trainer.train()
    return 0


if __name__ == "__main__":
    from agent.trainer.worker_exit import run_worker

    run_worker(main)  # sys.exit(main()) without the interpreter's teardown, which can abort
