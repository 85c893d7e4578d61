"""Distributed training computes what single-process training computes: proven on the CPU with gloo.

Each test builds the model, optimiser and loaders with the same functions the scripts use (training.py), and
runs the shared train_one_epoch / evaluate, so a change that breaks a property in the scripts breaks it here.

The step comparisons run in float64. DDP on 2 x B images and one process on 2B images add up the same numbers
in a different order, so in float32 they differ by rounding (about 1e-6 in a convolution's output), and a ReLU
whose input lies within that distance of zero passes its gradient in one run and blocks it in the other: seen
on an AVX2 CPU, one such element in layer3 changed every earlier layer's gradient by up to 1.7e-2 after one
step, and BatchNorm statistics over small batches grew the difference to 1e-2 in three. No setting makes
float32 sums independent of how a batch is split. In float64 rounding is 1e-16, the same comparison agrees to
1e-14 on any CPU, and a tolerance of 1e-10 leaves room for nothing but rounding: any real difference in what
the two runs compute (statistics, learning rate, loss averaging) is orders of magnitude larger.
"""

import argparse

import pytest
import torch
from spawn_world import spawn_world
from torch import nn
from torchvision.models import resnet34

import training
from multi_train_utils.distributed_utils import reduce_value
from multi_train_utils.train_eval_utils import train_one_epoch
from training import build_loaders, build_model, build_optimizer
from utils import read_split_data

B = 4  # images per rank per step
SIZE = 64  # at 32 px layer4 is 1x1, and BatchNorm over 8 values makes the steps needlessly ill-conditioned
# --lr of the DDP run: world size 2 trains at 0.001 (the scripts' default scale), as one process with --lr 0.001
# on the 2B images does. Much larger rates make a random network on random images diverge, and a diverging run
# amplifies float rounding (1e-7) past any tolerance within a few steps.
LR = 0.0005
TOLERANCE = 1e-10  # float64 rounding is about 1e-14 here; a semantic difference is 1e-4 or more


def run_args(**overrides):
    values = dict(
        seed=0, weights=None, freeze_layers=False, distributed=False, sync_bn=True, momentum=0.9,
        weight_decay=1e-4, epochs=10, lrf=0.1, img_size=32, batch_size=B, workers=0, local_world_size=1,
        device="cpu", channels_last=False, compile=False, persistent_workers=True, data_parallel=False,
    )  # fmt: skip
    return argparse.Namespace(**{**values, **overrides})


def global_batches(steps):
    """`steps` global batches of 2B images; rank r of 2 takes rows r*B..(r+1)*B of each."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(2 * B, 3, SIZE, SIZE, generator=g), torch.randint(0, 5, (2 * B,), generator=g))
        for _ in range(steps)
    ]


def group_norm_resnet(num_classes):
    """ResNet-34 whose normalisation uses each image alone (GroupNorm): no statistic crosses samples."""
    return resnet34(num_classes=num_classes, norm_layer=lambda channels: nn.GroupNorm(8, channels))


def _train_steps(rank, world_size, steps, sync_bn, per_sample_norm, lr, result_path):
    torch.set_default_dtype(torch.float64)  # this spawned process only: weights, batches, optimizer state
    if per_sample_norm:
        training.create_model = group_norm_resnet  # this spawned process only
    args = run_args(distributed=world_size > 1, sync_bn=sync_bn, lr=lr)
    model, bare = build_model(args, 5, torch.device("cpu"))
    initial = {name: tensor.clone() for name, tensor in bare.state_dict().items()}
    optimizer, _ = build_optimizer(args, model)  # the rate the scripts use: --lr times the world size
    rows = slice(rank * 2 * B // world_size, (rank + 1) * 2 * B // world_size)
    loss, images = train_one_epoch(model, optimizer, [(x[rows], y[rows]) for x, y in global_batches(steps)], "cpu", 0)
    if rank == 0:
        torch.save({"initial": initial, "state": bare.state_dict(), "loss": loss, "images": images}, result_path)


def train_both_ways(tmp_path, steps=3, sync_bn=True, per_sample_norm=False):
    spawn_world(_train_steps, 2, steps, sync_bn, per_sample_norm, LR, tmp_path / "ddp.pt")
    spawn_world(_train_steps, 1, steps, sync_bn, per_sample_norm, 2 * LR, tmp_path / "single.pt")
    return torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "single.pt")


def max_difference(a: dict, b: dict, only=lambda name: True) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if only(k) and a[k].is_floating_point())


@pytest.mark.guarantee
@pytest.mark.parametrize("steps", [1, 3])  # 3: momentum and weight decay take part
def test_ddp_with_sync_bn_takes_the_same_steps_as_one_process_on_the_whole_batch(tmp_path, steps):
    ddp, single = train_both_ways(tmp_path, steps)
    assert ddp["images"] == single["images"] == steps * 2 * B
    assert ddp["state"]["conv1.weight"].dtype == torch.float64
    assert max_difference(ddp["state"], single["state"]) <= TOLERANCE  # weights, and BatchNorm running statistics
    assert abs(ddp["loss"] - single["loss"]) <= TOLERANCE  # the logged loss: the mean over every sample of every rank
    assert max_difference(single["state"], single["initial"]) > 1e-3  # the steps did move the weights


@pytest.mark.guarantee
def test_without_sync_bn_ddp_differs_exactly_where_batch_statistics_enter(tmp_path):
    ddp, single = train_both_ways(tmp_path, sync_bn=False)
    assert max_difference(ddp["state"], single["state"], only=lambda k: "running_mean" in k) > 1e-4
    assert max_difference(ddp["state"], single["state"], only=lambda k: k.endswith("weight")) > 1e-5
    # The same network with per-image normalisation needs no synchronisation to match: the difference above
    # comes from BatchNorm's per-rank statistics, nothing else.
    ddp, single = train_both_ways(tmp_path, sync_bn=False, per_sample_norm=True)
    assert max_difference(ddp["state"], single["state"]) <= TOLERANCE


def _reduce(rank, world_size, result_path):
    value = torch.tensor([float(rank + 1)])
    torch.save(
        {"mean": reduce_value(value), "sum": reduce_value(value, average=False), "kept": value}, f"{result_path}.{rank}"
    )


def test_reduce_value_averages_or_sums_over_ranks_and_leaves_its_input_alone(tmp_path):
    spawn_world(_reduce, 3, tmp_path / "r")
    for rank in range(3):
        result = torch.load(f"{tmp_path / 'r'}.{rank}")
        assert result["mean"].item() == 2.0 and result["sum"].item() == 6.0
        assert result["kept"].item() == rank + 1


@pytest.mark.parametrize("batch_size", [1, 3])  # with 1, no batch is dropped that could hide a padded repeat
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(tiny_data, world_size, batch_size):
    split = read_split_data(tiny_data, seed=0)  # 50 training images
    args = run_args(batch_size=batch_size, local_world_size=world_size)

    def epoch_indices(epoch):
        shards = []
        for rank in range(world_size):
            loader = build_loaders(args, split, world_size, rank)[0]
            loader.batch_sampler.set_epoch(epoch)
            shards.append([index for batch in loader.batch_sampler for index, _seed in batch])
        return shards

    shards = epoch_indices(0)
    used = [i for shard in shards for i in shard]
    assert len(used) == len(set(used))  # disjoint, and no image repeated to pad a shard
    assert len({len(s) for s in shards}) == 1  # every rank takes the same number of steps
    assert len(split.train_images) - len(used) < world_size * args.batch_size  # only the documented remainder
    assert epoch_indices(0) == shards  # the same epoch gives the same shards...
    assert epoch_indices(1) != shards  # ...and the next epoch a new shuffle


@pytest.mark.guarantee
def test_augmented_tensors_do_not_depend_on_the_number_of_loader_workers(tiny_data):
    split = read_split_data(tiny_data, seed=0)

    def epoch_tensors(workers, epoch):
        loader = build_loaders(run_args(workers=workers), split, 1, 0)[0]
        loader.batch_sampler.set_epoch(epoch)
        return torch.cat([images for images, _ in loader])

    for epoch in (0, 1):
        reference = epoch_tensors(0, epoch)
        for workers in (1, 2):
            assert torch.equal(epoch_tensors(workers, epoch), reference), (workers, epoch)
    assert not torch.equal(epoch_tensors(0, 0), epoch_tensors(0, 1))
