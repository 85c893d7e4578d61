"""Micro-batches (--micro-batch): a batch taken in pieces that fit the device's memory trains as the whole batch.

The proofs run in float64 on the CPU with gloo, as tests/test_equivalence.py's do (its docstring says why: float32
sums depend on how a batch is split; float64 rounding is 1e-16, and a tolerance of 1e-10 leaves room for nothing
else). What a micro-batch changes is BatchNorm's: a piece is a batch to BatchNorm, its statistics the piece's (with
SyncBatchNorm, the pieces of every process at the same position). So:
- with normalisation of each image alone (GroupNorm), micro-batches of a batch take exactly the step of the whole
  batch, on one process and on two;
- with BatchNorm, with and without SyncBatchNorm, micro-batches of m images of a batch of B take exactly the step
  of --batch-size m --accumulate B/m at the rate that keeps the step's (--lr x m/B): the same global batch, the
  same rate, BatchNorm's statistics over the same images. Against the whole batch they differ, and only by that;
- gradient checkpointing (--grad-checkpointing) with micro-batches and --accumulate under DDP, with GroupNorm,
  BatchNorm and SyncBatchNorm, takes the steps of the same run without it (BatchNorm's statistics updated once).

Only a GPU runs out of memory and says so (torch.OutOfMemoryError); here the condition is substituted: a network
that raises it for a pass over more images than a limit.
"""

from unittest import mock

import pytest
import torch
from conftest import FAST, metrics_without_timings
from spawn_world import spawn_world
from test_equivalence import RECIPE, TOLERANCE, max_difference, snapshot
from wiring import built_once, group_norm_resnet10, model_as_trained, resnet10

import model as model_module
from autotune import choose as autotune
from autotune import timing
from multi_train_utils import memory
from multi_train_utils.train_eval_utils import Choice, Training, train_one_epoch
from network.architectures import DEFAULT_MODEL, create_model
from recipe.optimizer import build_optimizer
from run.config import Config

B, PIECE, SIZE, STEPS, LR = 4, 2, 16, 3, 0.0005  # a rank's batch, its micro-batch, pixels, batches, --lr
ACCUMULATE = 2  # batches a step sums: with STEPS 3, a step of two batches (three backward passes in no_sync), then
# the epoch's last of one


def rank_batches(rank: int, world_size: int, size: int) -> list:
    """This rank's rows of STEPS global batches of world_size x B images, in batches of `size` images."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        images = torch.randn(world_size * B, 3, SIZE, SIZE, generator=g)[rank * B : (rank + 1) * B]
        labels = torch.randint(0, 5, (world_size * B,), generator=g)[rank * B : (rank + 1) * B]
        batches += list(zip(images.split(size), labels.split(size), strict=True))
    return batches


# name: (GroupNorm, SyncBatchNorm, micro-batch, gradient checkpointing, world sizes). Each way trains batches of
# B images, ACCUMULATE a step, except "accumulated": batches of PIECE, B / PIECE times as many a step, at the rate
# that keeps the step's.
WAYS = {
    "group_norm whole": (True, False, None, False, (1, 2)),
    "group_norm pieces": (True, False, PIECE, False, (1, 2)),
    "group_norm pieces checkpointed": (True, False, PIECE, True, (2,)),
    "batch_norm whole": (False, False, None, False, (1,)),
    "batch_norm pieces": (False, False, PIECE, False, (1, 2)),
    "batch_norm accumulated": (False, False, None, False, (1, 2)),
    "batch_norm pieces checkpointed": (False, False, PIECE, True, (1,)),
    "sync_bn pieces": (False, True, PIECE, False, (2,)),
    "sync_bn accumulated": (False, True, None, False, (2,)),
    "sync_bn pieces checkpointed": (False, True, PIECE, True, (2,)),
}


def trained_ways(rank: int, world_size: int) -> dict:
    """Each way of `world_size` processes trained in float64 on this rank's rows: by name, the initial and final
    states and train_one_epoch's (mean loss, images)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    results, networks = {}, {True: built_once(group_norm_resnet10), False: built_once(resnet10)}
    try:
        for name, (group_norm, sync_bn, piece, checkpointed, world_sizes) in WAYS.items():
            if world_size not in world_sizes:
                continue
            with mock.patch.object(model_module, "create_model", networks[group_norm]):
                model, bare = model_as_trained(
                    5, sync_bn=sync_bn, distributed=world_size > 1, model="resnet18", grad_checkpointing=checkpointed
                )
            size, accumulate = (PIECE, ACCUMULATE * B // PIECE) if "accumulated" in name else (B, ACCUMULATE)
            # --accumulate k at --lr x size/B: the rate of the step (build_optimizer scales it by k)
            config = Config(lr=LR * size / B, accumulate=accumulate, **RECIPE)
            optimizer, _ = build_optimizer(model, config, 1, world_size=world_size)
            training = Training(model, optimizer, choice=Choice(micro_batch=piece), accumulate=accumulate)
            result = results[name] = {"initial": snapshot(bare)}
            result["loss"] = train_one_epoch(training, rank_batches(rank, world_size, size), "cpu", 0)
            result["state"] = snapshot(bare)
    finally:
        torch.set_default_dtype(dtype)
    return results


def _train_ways(rank, world_size, result_path):
    torch.set_num_threads(1)  # the processes share the machine's cores
    results = trained_ways(rank, world_size)
    if rank == 0:
        torch.save(results, result_path)


@pytest.fixture(scope="module")
def ways(tmp_path_factory):
    """By world size, each way's results: two processes in a gloo group, one in this process."""
    path = tmp_path_factory.mktemp("micro") / "two.pt"
    spawn_world(_train_ways, 2, path)
    return {1: trained_ways(0, 1), 2: torch.load(path, weights_only=True)}


@pytest.mark.guarantee
@pytest.mark.parametrize("world_size", [1, 2])
def test_micro_batches_take_the_step_of_the_whole_batch(ways, world_size):
    runs = ways[world_size]
    pieces, whole = runs["group_norm pieces"], runs["group_norm whole"]
    assert pieces["state"]["conv1.weight"].dtype == torch.float64
    assert max_difference(pieces["state"], whole["state"]) <= TOLERANCE
    assert abs(pieces["loss"][0] - whole["loss"][0]) <= TOLERANCE and pieces["loss"][1] == whole["loss"][1]
    assert max_difference(whole["state"], whole["initial"]) > 1e-3  # the steps moved the weights


@pytest.mark.guarantee
@pytest.mark.parametrize("world_size, norm", [(1, "batch_norm"), (2, "batch_norm"), (2, "sync_bn")])
def test_with_batch_norm_micro_batches_are_its_batches_and_the_step_is_unchanged(ways, world_size, norm):
    runs = ways[world_size]
    pieces, accumulated = runs[f"{norm} pieces"], runs[f"{norm} accumulated"]
    assert max_difference(pieces["state"], accumulated["state"]) <= TOLERANCE  # weights and running statistics
    assert abs(pieces["loss"][0] - accumulated["loss"][0]) <= TOLERANCE
    assert max_difference(pieces["state"], pieces["initial"]) > 1e-3


@pytest.mark.guarantee
def test_with_batch_norm_the_statistics_are_the_micro_batches_not_the_whole_batchs(ways):
    pieces, whole = ways[1]["batch_norm pieces"], ways[1]["batch_norm whole"]
    assert max_difference(pieces["state"], whole["state"], only=lambda k: "running" in k) > 1e-4
    assert max_difference(pieces["state"], whole["state"], only=lambda k: k.endswith("weight")) > 1e-5


@pytest.mark.guarantee
@pytest.mark.parametrize("world_size, norm", [(2, "group_norm"), (1, "batch_norm"), (2, "sync_bn")])
def test_gradient_checkpointing_takes_the_same_steps_under_ddp_with_accumulation(ways, world_size, norm):
    # micro-batches of 2 of batches of 4, --accumulate 2 (no_sync for 3 backward passes of 4), blocks recomputed
    checkpointed, plain = ways[world_size][f"{norm} pieces checkpointed"], ways[world_size][f"{norm} pieces"]
    assert max_difference(checkpointed["state"], plain["state"]) <= TOLERANCE  # BatchNorm's statistics updated once
    assert abs(checkpointed["loss"][0] - plain["loss"][0]) <= TOLERANCE
    assert max_difference(plain["state"], plain["initial"]) > 1e-3


LIMIT = 3  # the images a pass may take before the substituted memory runs out


class SmallMemory:
    """A device whose memory takes training passes of LIMIT images: every network built raises
    torch.OutOfMemoryError for one over more (a forward pre-hook), memory_limited says the CPU can run out, and
    `searched` counts the passes the search tried."""

    def __init__(self, monkeypatch):
        self.searched = []

        def built(num_classes, name=DEFAULT_MODEL):
            network = create_model(num_classes, name)
            network.register_forward_pre_hook(self.check)
            return network

        for where in (model_module, timing):
            monkeypatch.setattr(where, "create_model", built)
        monkeypatch.setattr(memory, "memory_limited", lambda device: True)
        monkeypatch.setattr(autotune, "memory_limited", lambda device: True)
        real = memory.pass_fits

        def counted(model, compute, images, *args, **kwargs):
            self.searched.append(len(images))
            return real(model, compute, images, *args, **kwargs)

        monkeypatch.setattr(timing, "pass_fits", counted)
        monkeypatch.setattr(memory, "pass_fits", counted)

    @staticmethod
    def check(module, inputs):
        if torch.is_grad_enabled() and len(inputs[0]) > LIMIT:  # validation keeps no activations for a backward
            raise torch.OutOfMemoryError(f"substituted: {len(inputs[0])} images, more than {LIMIT}")


def train(tiny_data, out, *flags):
    import train_single_gpu

    train_single_gpu.main(
        [str(flag) for flag in ("--data-path", tiny_data, "--epochs", "1", *FAST, *flags, "--output-dir", out)]
    )


@pytest.mark.guarantee
def test_auto_settles_on_the_largest_micro_batch_that_fits_and_remembers_it(tiny_data, tmp_path, monkeypatch, capsys):
    train(tiny_data, tmp_path / "whole")  # the whole batch of 8 (FAST's): no memory limit on the CPU
    whole = capsys.readouterr().out
    small = SmallMemory(monkeypatch)
    train(tiny_data, tmp_path / "auto", "--remeasure")
    said = capsys.readouterr().out
    assert "Auto: micro-batches of 3 images, the most that fit in the memory of resnet18 at 32 px on cpu" in said
    assert small.searched == [8, 4, 2, 3]  # the whole batch first, then bisected
    rate = next(line for line in whole.splitlines() if line.startswith("Learning rate"))
    assert rate in said and "global batch of 8" in rate  # the recipe unchanged: batch, rate, schedule
    lrs = [line["lr"] for line in metrics_without_timings(tmp_path / "auto")]
    assert lrs == [line["lr"] for line in metrics_without_timings(tmp_path / "whole")]
    # remembered: the next run takes it without trying a pass
    small.searched.clear()
    train(tiny_data, tmp_path / "again")
    assert "micro-batches of 3, as measured on" in capsys.readouterr().out and small.searched == []


@pytest.mark.guarantee
def test_running_out_of_memory_while_training_ends_in_one_line_naming_the_flag(tiny_data, tmp_path, run_main):
    flags = ("--data-path", tiny_data, "--epochs", "1", *FAST, "--micro-batch", "8", "--output-dir", tmp_path / "out")
    with pytest.MonkeyPatch.context() as monkeypatch:
        SmallMemory(monkeypatch)
        result = run_main("train_single_gpu", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "out of memory on cpu training micro-batches of 8 images: --micro-batch 3 fits now" in lines[0]
