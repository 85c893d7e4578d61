"""Distributed semantics checked inside gloo process groups on the CPU."""

import pytest
import torch
from spawn_world import spawn_world
from torch import nn
from wiring import loaders

from dataset.folders import read_split_data
from dataset.transforms import normalise, val_transform
from multi_train_utils.sync_batchnorm import SyncBatchNorm2d
from multi_train_utils.train_eval_utils import evaluate
from my_dataset import MyDataSet
from network.architectures import create_model

VAL_RATE = 7 / 12  # tiny_data has 12 images per class: 7 of each validate, 35 in all, which neither 2 nor 3 divides


def model_with_varied_predictions(split):
    """An untrained ResNet whose BatchNorm statistics come from the validation images (all of them, on every
    rank), so its predictions differ from image to image instead of all naming one class."""
    torch.manual_seed(0)
    model = create_model(len(split.classes))
    images = normalise(
        torch.stack([image for image, _ in MyDataSet(split.val_images, split.val_labels, val_transform(32))])
    )
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None  # a plain average over the calibration batch
    with torch.no_grad():
        model.train()(images)
    return model


def shard_confusion(rank, world_size, data_path) -> torch.Tensor:
    """The confusion matrix evaluate() returns in process `rank` of `world_size`: summed over every rank."""
    split = read_split_data(data_path, val_rate=VAL_RATE, seed=0)
    _, val_loader = loaders(split, img_size=32, batch_size=4, seed=0, world_size=world_size, rank=rank)
    model = model_with_varied_predictions(split)
    return evaluate(model, val_loader, torch.device("cpu"), len(split.classes))


def _evaluate_shard(rank, world_size, data_path, result_path):
    confusion = shard_confusion(rank, world_size, data_path)
    if rank == 0:
        torch.save(confusion, result_path)


@pytest.fixture(scope="module")
def single_process_confusion(tiny_data):
    return shard_confusion(0, 1, tiny_data)  # a world of one: no process group, nothing to reduce


@pytest.mark.guarantee
@pytest.mark.parametrize("world_size", [2, 3])
def test_validation_counts_every_image_once_whatever_the_world_size(
    tiny_data, tmp_path, single_process_confusion, world_size
):
    split = read_split_data(tiny_data, val_rate=VAL_RATE, seed=0)
    total = len(split.val_images)
    assert total % 2 and total % 3, f"pick a validation size neither 2 nor 3 divides, not {total}"
    spawn_world(_evaluate_shard, world_size, tiny_data, tmp_path / "ddp.pt")
    single, ddp = single_process_confusion, torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert int(single.sum()) == total  # nothing padded, nothing dropped
    assert (single.sum(dim=0) > 0).sum() >= 2, "the model should predict more than one class"
    assert torch.equal(ddp, single)  # same correct count, same per-class counts


def _sync_bn_step(rank, world_size, x, result_path):
    torch.manual_seed(0)
    bn = SyncBatchNorm2d(3)
    nn.init.uniform_(bn.weight)
    shard = x.chunk(world_size)[rank].clone().requires_grad_()
    out = bn(shard)
    (out * torch.arange(out.numel()).view_as(out).float()).sum().backward()
    torch.save(
        {"out": out.detach(), "grad": shard.grad, "w": bn.weight.grad, "mean": bn.running_mean, "var": bn.running_var},
        f"{result_path}.{rank}",
    )


@pytest.mark.guarantee
def test_cpu_sync_batchnorm_equals_batchnorm_over_the_whole_batch(tmp_path):
    x = torch.randn(6, 3, 5, 4, generator=torch.Generator().manual_seed(1)) * 3 + 1
    spawn_world(_sync_bn_step, 2, x, tmp_path / "r")
    parts = [torch.load(f"{tmp_path / 'r'}.{rank}", weights_only=True) for rank in range(2)]

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    nn.init.uniform_(bn.weight)
    full = x.clone().requires_grad_()
    out = bn(full)
    weights = torch.cat([torch.arange(p["out"].numel()).view_as(p["out"]).float() for p in parts])
    (out * weights).sum().backward()

    torch.testing.assert_close(torch.cat([p["out"] for p in parts]), out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p["grad"] for p in parts]), full.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts[0]["w"] + parts[1]["w"], bn.weight.grad, atol=1e-5, rtol=1e-5)
    for p in parts:
        torch.testing.assert_close(p["mean"], bn.running_mean)
        torch.testing.assert_close(p["var"], bn.running_var)
