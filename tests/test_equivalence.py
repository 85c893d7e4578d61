"""Distributed training computes what single-process training computes: proven on the CPU with gloo.

Each test builds the model, optimiser and loaders as the scripts do (tests/wiring.py, from the same functions), and
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

from unittest import mock

import pytest
import torch
from spawn_world import spawn_world
from wiring import group_norm_resnet10, loaders, model_as_trained, resnet10

import model as model_module
from dataset.folders import read_split_data
from multi_train_utils.checkpoint import restore, training_state
from multi_train_utils.distributed_utils import reduce_value
from multi_train_utils.train_eval_utils import Training, train_one_epoch
from recipe.optimizer import build_optimizer
from run.config import Config
from run.plan import per_process_recipe
from utils import UserError

# A ResNet of one block a stage (tests/wiring.py's resnet10): the default ResNet-34's kinds of layer, with one block
# where ResNet-34 repeats 3 to 6. What is compared (gradients averaged, statistics synchronised, rates scaled) does
# not depend on how many blocks repeat, and in float64 each repeat makes every comparison longer.
NETWORK = "resnet18"  # the name the scripts' wiring is given; create_model builds resnet10 in its place
B = 4  # images per rank per step
SIZE = 32  # in float64 the steps agree to 4e-13 at 32 px too (1e-14 at 64), at a quarter of the work
# --lr of the DDP run: world size 2 trains at 0.001 (the scripts' default scale), as one process with --lr 0.001
# on the 2B images does. Much larger rates make a random network on random images diverge, and a diverging run
# amplifies float rounding (1e-7) past any tolerance within a few steps.
LR = 0.0005
TOLERANCE = 1e-10  # float64 rounding is about 1e-14 here; a semantic difference is 1e-4 or more


# The scripts' recipe apart from the rate: SGD with momentum and weight decay, the cosine schedule.
RECIPE = dict(momentum=0.9, weight_decay=1e-4, epochs=10, lrf=0.1)


def global_batches(steps):
    """`steps` global batches of 2B images; rank r of 2 takes rows r*B..(r+1)*B of each."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(2 * B, 3, SIZE, SIZE, generator=g), torch.randint(0, 5, (2 * B,), generator=g))
        for _ in range(steps)
    ]


# The networks compared, each trained the same few steps both ways: (SyncBN, per-image normalisation).
VARIANTS = {"sync_bn": (True, False), "batch_norm": (False, False), "group_norm": (False, True)}
STEPS = 3  # the state after the first step is kept too; by the third, momentum and weight decay take part


def _train_variants(rank, world_size, lr, result_path):
    """Every variant trained STEPS steps in this process of `world_size`, on its rows of the global batches."""
    torch.set_default_dtype(torch.float64)  # this spawned process only: weights, batches, optimizer state
    rows = slice(rank * 2 * B // world_size, (rank + 1) * 2 * B // world_size)
    batches = [(x[rows], y[rows]) for x, y in global_batches(STEPS)]
    results = {}
    for name, (sync_bn, per_sample_norm) in VARIANTS.items():
        with mock.patch.object(model_module, "create_model", group_norm_resnet10 if per_sample_norm else resnet10):
            model, bare = model_as_trained(5, sync_bn=sync_bn, distributed=world_size > 1, model=NETWORK)
        # the rate the scripts use: --lr times the world size
        optimizer, _ = build_optimizer(model, Config(lr=lr, **RECIPE), 1, world_size=world_size)
        # Kept for the comparisons alone (each state is a float64 ResNet-10, 40 MB to save and load): the initial
        # weights of the single process, which the tests check the steps moved; the state after the first step
        # of the SyncBN network, which they compare then too.
        result = {"initial": snapshot(bare)} if world_size == 1 else {}
        result["loss_1"], _ = train_one_epoch(Training(model, optimizer), batches[:1], "cpu", 0)
        if sync_bn:
            result["state_1"] = snapshot(bare)
        result["loss"], result["images"] = train_one_epoch(Training(model, optimizer), batches[1:], "cpu", 0)
        result["state"] = snapshot(bare)
        results[name] = result
    if rank == 0:
        torch.save(results, result_path)


def snapshot(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    """Each variant's results from DDP on 2 x B images per step (--lr LR) and from one process on the 2B images
    (--lr 2 LR): the rates the scripts use for the same global batch."""
    folder = tmp_path_factory.mktemp("steps")
    spawn_world(_train_variants, 2, LR, folder / "ddp.pt")
    spawn_world(_train_variants, 1, 2 * LR, folder / "single.pt")
    return torch.load(folder / "ddp.pt", weights_only=True), torch.load(folder / "single.pt", weights_only=True)


def max_difference(a: dict, b: dict, only=lambda name: True) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if only(k) and a[k].is_floating_point())


@pytest.mark.guarantee
def test_ddp_with_sync_bn_takes_the_same_steps_as_one_process_on_the_whole_batch(both_ways):
    ddp, single = (run["sync_bn"] for run in both_ways)
    assert ddp["images"] == single["images"] == (STEPS - 1) * 2 * B
    assert ddp["state"]["conv1.weight"].dtype == torch.float64
    for state, loss in (("state_1", "loss_1"), ("state", "loss")):  # after one step, and after three
        assert max_difference(ddp[state], single[state]) <= TOLERANCE, state  # weights, BatchNorm running statistics
        assert abs(ddp[loss] - single[loss]) <= TOLERANCE, loss  # the logged loss: the mean over every rank's samples
    assert max_difference(single["state"], single["initial"]) > 1e-3  # the steps did move the weights


@pytest.mark.guarantee
def test_without_sync_bn_ddp_differs_exactly_where_batch_statistics_enter(both_ways):
    ddp, single = (run["batch_norm"] for run in both_ways)
    assert max_difference(ddp["state"], single["state"], only=lambda k: "running_mean" in k) > 1e-4
    assert max_difference(ddp["state"], single["state"], only=lambda k: k.endswith("weight")) > 1e-5
    # The same network with per-image normalisation needs no synchronisation to match: the difference above
    # comes from BatchNorm's per-rank statistics, nothing else.
    ddp, single = (run["group_norm"] for run in both_ways)
    assert max_difference(ddp["state"], single["state"]) <= TOLERANCE
    assert max_difference(single["state"], single["initial"]) > 1e-3


def _reduce(rank, world_size, result_path):
    value = torch.tensor([float(rank + 1)])
    torch.save(
        {"mean": reduce_value(value), "sum": reduce_value(value, average=False), "kept": value}, f"{result_path}.{rank}"
    )


def test_reduce_value_averages_or_sums_over_ranks_and_leaves_its_input_alone(tmp_path):
    spawn_world(_reduce, 3, tmp_path / "r")
    for rank in range(3):
        result = torch.load(f"{tmp_path / 'r'}.{rank}", weights_only=True)
        assert result["mean"].item() == 2.0 and result["sum"].item() == 6.0
        assert result["kept"].item() == rank + 1


@pytest.mark.parametrize("batch_size", [1, 3])  # with 1, no batch is dropped that could hide a padded repeat
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.fast
def test_training_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(tiny_data, world_size, batch_size):
    split = read_split_data(tiny_data, seed=0)  # 50 training images

    def epoch_indices(epoch):
        shards = []
        for rank in range(world_size):
            loader = loaders(split, img_size=32, batch_size=batch_size, seed=0, world_size=world_size, rank=rank)[0]
            loader.batch_sampler.set_epoch(epoch)
            shards.append([index for batch in loader.batch_sampler for index, _seed in batch])
        return shards

    shards = epoch_indices(0)
    used = [i for shard in shards for i in shard]
    assert len(used) == len(set(used))  # disjoint, and no image repeated to pad a shard
    assert len({len(s) for s in shards}) == 1  # every rank takes the same number of steps
    assert len(split.train_images) - len(used) < world_size * batch_size  # only the documented remainder
    assert epoch_indices(0) == shards  # the same epoch gives the same shards...
    assert epoch_indices(1) != shards  # ...and the next epoch a new shuffle


@pytest.mark.guarantee
@pytest.mark.fast
def test_augmented_tensors_do_not_depend_on_the_number_of_loader_workers(tiny_data):
    split = read_split_data(tiny_data, seed=0)

    def epoch_tensors(workers, epoch):
        loader = loaders(split, img_size=32, batch_size=B, seed=0, workers=workers)[0]
        loader.batch_sampler.set_epoch(epoch)
        return torch.cat([images for images, _ in loader])

    for epoch in (0, 1):
        reference = epoch_tensors(0, epoch)
        for workers in (1, 2):
            assert torch.equal(epoch_tensors(workers, epoch), reference), (workers, epoch)
    assert not torch.equal(epoch_tensors(0, 0), epoch_tensors(0, 1))


def _train_accumulated(rank, world_size, lr, result_path):
    """The per-image-normalised network trained STEPS steps in this process of `world_size`, each step summing
    the gradients of two micro-batches: the halves of this rank's rows of a global batch (--accumulate 2)."""
    torch.set_default_dtype(torch.float64)
    rows = slice(rank * 2 * B // world_size, (rank + 1) * 2 * B // world_size)
    micro_batches = []
    for images, labels in global_batches(STEPS):
        images, labels, half = images[rows], labels[rows], B // world_size
        micro_batches += [(images[:half], labels[:half]), (images[half:], labels[half:])]
    with mock.patch.object(model_module, "create_model", group_norm_resnet10):
        model, bare = model_as_trained(5, distributed=world_size > 1, model=NETWORK)
    optimizer, _ = build_optimizer(model, Config(lr=lr, accumulate=2, **RECIPE), 1, world_size=world_size)
    loss, images = train_one_epoch(Training(model, optimizer, accumulate=2), micro_batches, "cpu", 0)
    if rank == 0:
        torch.save({"loss": loss, "images": images, "state": snapshot(bare)}, result_path)


@pytest.mark.guarantee
def test_accumulating_two_micro_batches_takes_the_step_of_one_batch_twice_as_large(both_ways, tmp_path):
    # --accumulate 2 scales the rate by 2 as DDP scales it by the world size: the same global batch, the same rate
    spawn_world(_train_accumulated, 1, LR, tmp_path / "one.pt")  # one process: micro-batches of B
    spawn_world(_train_accumulated, 2, LR / 2, tmp_path / "ddp.pt")  # DDP: micro-batches of B / 2 on each rank
    whole = both_ways[1]["group_norm"]  # one process, one step on all 2B images at a time
    for path in ("one.pt", "ddp.pt"):
        accumulated = torch.load(tmp_path / path, weights_only=True)
        assert accumulated["images"] == STEPS * 2 * B
        assert max_difference(accumulated["state"], whole["state"]) <= TOLERANCE, path
        # the logged loss is the mean over every image, as without accumulation
        expected = (whole["loss_1"] * 2 * B + whole["loss"] * (STEPS - 1) * 2 * B) / (STEPS * 2 * B)
        assert abs(accumulated["loss"] - expected) <= TOLERANCE, path


# Resuming on another number of processes (run/plan.py per_process_recipe): each process takes its share of
# the same global batch at the scaled rate, so the resumed steps are the steps the run would have taken.
def _resize_legs(rank, world_size, config: Config, legs: list[tuple]):
    """The SyncBN network trained in this process of `world_size` on its rows of the global batches, once per leg
    (checkpoint, result path): from its initial weights (checkpoint None), rank 0 saving the training state to
    the checkpoint after the first step; or from the checkpoint, for the steps after the first. Rank 0 saves the
    final weights to the result path."""
    torch.set_default_dtype(torch.float64)
    rows = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
    batches = [(x[rows], y[rows]) for x, y in global_batches(STEPS)]
    for checkpoint, result_path in legs:
        with mock.patch.object(model_module, "create_model", resnet10):
            model, bare = model_as_trained(5, sync_bn=True, distributed=world_size > 1, model=NETWORK)
        training = Training(model, *build_optimizer(model, config, 1, world_size=world_size))
        if checkpoint.exists():
            restore(torch.load(checkpoint, weights_only=True), bare, training)
        else:
            train_one_epoch(training, batches[:1], "cpu", 0)
            if rank == 0:
                torch.save(training_state(0, bare, training, 0.0, [], world_size, {}), checkpoint)
        train_one_epoch(training, batches[1:], "cpu", 1)
        if rank == 0:
            torch.save(snapshot(bare), result_path)


def resized(world_size_then: int, batch_size: int, lr: float, world_size: int) -> Config:
    """The configuration a run of `world_size_then` processes of batch_size and lr resumes with on `world_size`."""
    saved = {"world_size": world_size_then}
    return per_process_recipe(Config(batch_size=batch_size, lr=lr, **RECIPE), saved, world_size, None)[0]


@pytest.mark.guarantee
def test_a_run_resumed_on_another_number_of_processes_takes_the_steps_of_the_uninterrupted_run(tmp_path):
    two, one = Config(batch_size=B, lr=LR, **RECIPE), Config(batch_size=2 * B, lr=2 * LR, **RECIPE)
    assert resized(2, B, LR, 1) == one and resized(1, 2 * B, 2 * LR, 2) == two  # per process: 2B at 2 LR, B at LR
    path = tmp_path.joinpath
    # uninterrupted on 2, saving its first step; on 1 from scratch (saving its first step) and from the 2's step
    spawn_world(_resize_legs, 2, two, [(path("two.pth"), path("two.pt"))])
    spawn_world(
        _resize_legs, 1, resized(2, B, LR, 1), [(path("one.pth"), path("one.pt")), (path("two.pth"), path("2to1.pt"))]
    )
    spawn_world(_resize_legs, 2, resized(1, 2 * B, 2 * LR, 2), [(path("one.pth"), path("1to2.pt"))])
    uninterrupted = torch.load(path("two.pt"), weights_only=True)
    for name in ("one.pt", "2to1.pt", "1to2.pt"):
        assert max_difference(torch.load(path(name), weights_only=True), uninterrupted) <= TOLERANCE, name
    saved = torch.load(path("two.pth"), weights_only=True)["model"]
    assert max_difference(uninterrupted, saved) > 1e-3  # the later steps moved it


@pytest.mark.fast
@pytest.mark.parametrize("then, batch_size, now", [(2, 8, 3), (1, 1, 2), (4, 6, 16)])
def test_a_global_batch_that_does_not_split_over_the_new_processes_is_refused_in_one_line(then, batch_size, now):
    with pytest.raises(UserError, match=f"cannot be shared evenly by {now} processes"):
        resized(then, batch_size, LR, now)
    assert resized(then, batch_size, LR, then) == Config(batch_size=batch_size, lr=LR, **RECIPE)  # unchanged
