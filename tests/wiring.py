"""The training scripts' wiring, for the tests that check its properties piece by piece: each helper makes what
train_multi_gpu_using_launch.py's `train` makes (train_single_gpu.py's, with a world of one), from the same
functions, in the same way. Keep them in step with the scripts."""

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from model import initial_model
from multi_train_utils.distributed_utils import shuffled_batches, val_shard
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from my_dataset import datasets
from plumbing.compute import Compute
from plumbing.config import Config


def loaders(split, img_size: int, batch_size: int, seed: int, world_size=1, rank=0, workers=0, **augment):
    """(training loader, validation loader) of process `rank` of `world_size`, with `workers` loader workers and
    the augmentation flags `augment` (auto_augment, random_erase)."""
    train_set, val_set, _ = datasets(split, Config(img_size=img_size, **augment))
    loading = {"num_workers": workers, "persistent_workers": workers > 0}
    batches = shuffled_batches(train_set, batch_size, seed, rank, world_size)
    val_sampler = val_shard(val_set, rank, world_size)
    return (
        DataLoader(train_set, batch_sampler=batches, **loading),
        DataLoader(val_set, batch_size=batch_size, sampler=val_sampler, **loading),
    )


def model_as_trained(num_classes: int, compute: Compute = Compute(), sync_bn=False, distributed=False, compile=False):
    """(the model as it is trained: in DDP wrapped, with SyncBatchNorm when `sync_bn`; compiled when `compile`,
    the model itself, for evaluating and saving), seeded with 0, on the CPU."""
    model = initial_model("resnet34", num_classes, torch.device("cpu"), compute.memory_format)
    trained = model
    if distributed:
        if sync_bn:
            model = convert_sync_batchnorm(model, torch.device("cpu"))
        trained = DistributedDataParallel(model)
    return (torch.compile(trained) if compile else trained), model
