"""The PyTorch DDP tutorial's multi-node script (pytorch/examples, distributed/ddp-tutorial-series/
multinode.py), ported to CPU: no fleetd import. It saves ``snapshot.pt`` every ``save_every``
epochs from each node's local rank 0 and resumes from it when it exists. fleetd runs it in folder
mode with no change to its code: job.toml beside it is its job file (`fleetd demo --job
deploy/examples/ddp-job/job.toml` runs it), the way a user's own project would be shipped.

    torchrun --nproc-per-node=1 train.py 50 5 --snapshot_path /ckpt/snapshot.pt

Differences from the tutorial, all mechanical: gloo and CPU tensors instead of NCCL and a GPU
(no ``device_ids``); ``--snapshot_path`` (the tutorial hard-codes ``snapshot.pt`` in the working
directory); ``--sleep`` per batch, standing in for a real model's step time on a small test box.
Like the tutorial, it stores the epoch it just finished as ``EPOCHS_RUN`` and so runs that epoch
again after a resume.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

Sample = tuple[torch.Tensor, torch.Tensor]


class MyTrainDataset(Dataset[Sample]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader[Sample],
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        sleep: float,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.sleep = sleep
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        self.optimizer.step()
        time.sleep(self.sleep)

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        assert isinstance(self.train_data.sampler, DistributedSampler)  # prepare_dataloader's
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        assert isinstance(self.model, DDP)  # wrapped in __init__
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[MyTrainDataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset[Sample], batch_size: int) -> DataLoader[Sample]:
    return DataLoader(
        dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset)
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, sleep: float) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, sleep)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--sleep", default=0.0, type=float, help="seconds per batch (pacing on a small box)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.sleep)
