"""Test-only fault injection, loaded by Python at start-up in every process when this folder is on PYTHONPATH.

FAULT=raise:RANK:EPOCH  rank RANK raises at the start of epoch EPOCH
FAULT=nan:EPOCH         every rank's images of epoch EPOCH become NaN (a non-finite loss)
FAULT=slow              each training step sleeps 0.2 s (to kill a run in the middle of an epoch)

The scripts are untouched; this replaces training.train_one_epoch in the process before they run.
"""

import os

if os.environ.get("FAULT"):
    import time

    import torch
    import torch.distributed as dist

    import training

    kind, *numbers = os.environ["FAULT"].split(":")
    real_train_one_epoch = training.train_one_epoch

    def faulty_train_one_epoch(model, optimizer, data_loader, device, epoch, *how):
        rank = dist.get_rank() if dist.is_initialized() else 0
        if kind == "raise" and [rank, epoch] == [int(n) for n in numbers]:
            raise RuntimeError(f"injected failure on rank {rank} at epoch {epoch}")
        if kind == "nan" and epoch == int(numbers[0]):
            data_loader = [(images * torch.nan, labels) for images, labels in data_loader]
        if kind == "slow":
            data_loader = (batch for batch in data_loader if time.sleep(0.2) is None)
        return real_train_one_epoch(model, optimizer, data_loader, device, epoch, *how)

    training.train_one_epoch = faulty_train_one_epoch
