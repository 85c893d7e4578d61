"""The exact resume across the cases it promises: networks that draw random numbers in their forward pass
(dropout: MobileNetV3; stochastic depth and dropout: EfficientNet) and timm's models, loader workers 0, 1 and 2,
persistent or not, and every recipe switch that draws random numbers (mixup, cutmix, random erasing,
TrivialAugment), stopped by a signal within an epoch or crashed at an epoch's start (the checkpoint of the last
epoch, as after kill -9): the resumed run ends bitwise as the uninterrupted one, its weights and every epoch's
metrics.

The runs are the scripts' own mains, called in this process (a run of these tiny networks takes a second or two;
an interpreter importing torch anew would take longer). A stop is the scripts' own: a signal noted at a step, as
the handler notes SIGTERM (test_preemption.py sends real signals to real processes: ResNet-18 in one process,
MobileNetV3-Small on two ranks under torchrun and spawn; test_failures.py kills one with SIGKILL)."""

import importlib
import signal
import types
from dataclasses import replace

import pytest
import torch
from conftest import FAST, PINNED_COMPUTE, final_weights, metrics_without_timings

from autotune.choose import choose
from dataset.folders import DataSplit
from multi_train_utils import stop_and_resume
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.distributed_utils import single_process
from multi_train_utils.train_eval_utils import Choice
from run.config import Config
from run.plan import announce, inexact_resume_note, per_process_recipe

# Epoch 0 stopped at its 3rd step of 6, or a crash at the start of epoch 1; 2 epochs in all.
STOP, CRASH = ("stop", 0, 2), ("crash", 1)
FLAGS = ("--epochs", "2", *FAST[:4], *PINNED_COMPUTE)  # 32 px, batch 8, bfloat16 where native, NCHW
SWITCHES = (
    "--mixup-alpha",
    "0.2",
    "--cutmix-alpha",
    "1.0",
    "--random-erase",
    "0.5",
    "--auto-augment",
    "trivialaugment",
)
# (script, network, recipe switches, [(loader workers, persistent, interruption), ...]), each against one
# uninterrupted run with the first cell's workers (the images do not depend on the number of workers:
# test_equivalence.py's test_augmented_tensors_do_not_depend_on_the_number_of_loader_workers).
MATRIX = [
    ("train_single_gpu", "mobilenet_v3_small", (), [(0, True, STOP), (2, True, STOP), (1, False, CRASH)]),
    ("train_single_gpu", "efficientnet_b0", SWITCHES, [(0, True, STOP), (2, False, CRASH)]),
    ("train_multi_gpu_using_launch", "efficientnet_b0", SWITCHES, [(1, True, STOP)]),  # DDP, a group of one
    # timm's models, with timm's own layers (BatchNormAct2d, its initialisation): timm/NAME builds them without
    # dropout or drop path (timm's defaults), so here the recipe's switches alone draw
    ("train_single_gpu", "timm/test_efficientnet", SWITCHES, [(1, True, STOP), (0, False, CRASH)]),
]


def workers(count: int, persistent: bool) -> tuple:
    return "--workers", count, "--persistent-workers" if persistent else "--no-persistent-workers"


class Crash(Exception):
    """A process dying at the start of an epoch: what it leaves is the checkpoint of the epoch before."""


class StopAt:
    """The loader's batches, with a stop signal noted as batch `step` loads (the handler's note: the run stops at
    the step its ranks agree on, then saves it)."""

    def __init__(self, data_loader, step: int):
        self.data_loader, self.step = data_loader, step

    def __len__(self):
        return len(self.data_loader)

    def __iter__(self):
        for step, batch in enumerate(self.data_loader):
            if step == self.step:
                stop_and_resume.noted.append(signal.SIGTERM)
            yield batch


def run(script: str, flags, monkeypatch, interruption=None) -> None:
    """`script`'s main on `flags`, interrupted as `interruption` says (None: not at all)."""
    module = importlib.import_module(script)
    real = module.train_one_epoch

    def interrupted(training, data_loader, device, epoch, *how, **options):
        if interruption == ("crash", epoch):
            raise Crash
        if interruption and interruption[0] == "stop" and epoch == interruption[1]:
            data_loader = StopAt(data_loader, interruption[2])
        return real(training, data_loader, device, epoch, *how, **options)

    monkeypatch.setattr(module, "train_one_epoch", interrupted)
    try:
        module.main([str(flag) for flag in flags])
    except SystemExit as stop:  # stopped by the signal: 128 + SIGTERM; a finished run returns
        assert interruption and interruption[0] == "stop" and stop.code == 128 + signal.SIGTERM, stop.code
    except Crash:
        assert interruption and interruption[0] == "crash"
    finally:
        monkeypatch.setattr(module, "train_one_epoch", real)


@pytest.mark.parametrize("script, network, switches, cells", MATRIX, ids=[f"{m[0]}-{m[1]}" for m in MATRIX])
def test_every_interrupted_run_resumes_to_the_uninterrupted_runs_weights_and_metrics(
    tiny_data, tmp_path, monkeypatch, script, network, switches, cells
):
    flags = ("--data-path", tiny_data, *FLAGS, "--model", network, *switches)
    run(script, (*flags, *workers(*cells[0][:2]), "--output-dir", tmp_path / "whole"), monkeypatch)
    expected, expected_metrics = final_weights(tmp_path / "whole"), metrics_without_timings(tmp_path / "whole")
    for count, persistent, interruption in cells:
        out = tmp_path / f"{interruption[0]}-{count}-{persistent}"
        cell = (*flags, *workers(count, persistent), "--output-dir", out)
        run(script, cell, monkeypatch, interruption)
        state = load_checkpoint(out / "checkpoint.pth")
        assert ("midway" in state) == (interruption[0] == "stop")  # a step of epoch 0, or the end of epoch 0
        run(script, (*cell, "--auto-resume"), monkeypatch)
        weights = final_weights(out)
        assert all(torch.equal(expected[k], weights[k]) for k in expected), f"{interruption}, {count} workers"
        assert metrics_without_timings(out) == expected_metrics


# (network, --sync-bn, the run's (micro-batch or None, processes), the resume's, the layers the note names): the
# images of a forward pass change with the number of processes and with --micro-batch; dropout draws a mask per
# process and pass, BatchNorm takes a pass's statistics (with --sync-bn, of the passes of every process together)
RESUMES = [
    ("resnet18", True, (None, 2), (None, 1), ()),  # SyncBatchNorm over the same 8 images: exact (test_equivalence)
    ("resnet18", False, (None, 2), (None, 1), ("BatchNorm2d",)),  # each process's 4 images, now 8
    ("mobilenet_v3_small", True, (None, 2), (None, 1), ("Dropout",)),  # masks for 4 images, now for 8
    ("mobilenet_v3_small", True, (None, 1), (None, 1), ()),  # nothing changed
    ("resnet18", True, (4, 1), (None, 1), ("BatchNorm2d",)),  # micro-batches of 4, now the whole batch of 8
    ("mobilenet_v3_small", True, (None, 1), (2, 1), ("Dropout", "BatchNorm2d")),
    ("vit_b_16", True, (None, 1), (2, 1), ()),  # LayerNorm normalises each image alone, and its dropout is off
]


@pytest.mark.fast
@pytest.mark.parametrize("network, sync_bn, before, now, layers", RESUMES)
def test_a_resume_says_when_another_forward_pass_makes_it_inexact(network, sync_bn, before, now, layers):
    # The recipe holds (per_process_recipe: the same global batch and rate); exactness cannot, and the run says so.
    config = Config(model=network, batch_size=8 // before[1], lr=0.1, sync_bn=sync_bn)
    saved = {"batch_size": config.batch_size, "micro_batch": before[0]} | {"world_size": before[1]}
    resized, _ = per_process_recipe(config, saved | {"recipe_world_size": before[1]}, now[1], "run/checkpoint.pth")
    assert resized.batch_size * now[1] == 8 and resized.lr * now[1] == 0.1 * before[1]
    note = inexact_resume_note(resized, saved | {"recipe_world_size": before[1]}, now[1], Choice(micro_batch=now[0]))
    said = [] if note is None else [note]
    if not layers:
        assert not said
    else:
        assert said == [
            f"note: {network}'s {' and '.join(layers)} layers compute per forward pass, which now takes "
            f"{now[0] or 8 // now[1]} images on each of {now[1]} process(es), {before[0] or 8 // before[1]} on each "
            f"of {before[1]} before: this run keeps the recipe, not the uninterrupted run's exact weights "
            "(docs/resuming-and-failures.md)"
        ]


@pytest.mark.fast
def test_a_resume_with_another_micro_batch_says_so_as_it_decides_how_to_compute(capsys, monkeypatch):
    # choose (autotune/choose.py) decides the micro-batch, given or measured; then the run says what it changes, as
    # it announces itself (run/plan.py)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # this test process's threads stay
    config = Config(model="resnet18", batch_size=8, lr=0.1, amp="off", channels_last=False, workers=0, micro_batch=4)
    config = replace(config, batches="loader")  # nothing measured: no images to make batches of
    saved = {"batch_size": 8, "micro_batch": None, "world_size": 1, "recipe_world_size": 1}
    split = DataSplit(["a.jpg"] * 8, [0] * 8, ["b.jpg"] * 2, [0, 1], ["a", "b"])
    plan = types.SimpleNamespace(
        saved=saved, split=split, recipe_lines=(), images_line="Images: decoded from their files every epoch"
    )
    choice = choose(config, plan, torch.device("cpu"), 1, train_set=None)
    assert choice.micro_batch == 4
    announce(config, plan, single_process("cpu"), choice)
    assert "note: resnet18's BatchNorm2d layers compute per forward pass, which now takes 4" in capsys.readouterr().out
