"""The training recipe's options in real runs of the scripts, as a user runs them.

What it proves, on tiny_data at 32 px:
- --model: resnet18, mobilenet_v3_small and efficientnet_b0 train, their best.pth and last.pth load strictly into
  torchvision's model of that name, and predict.py and evaluate.py run on them, evaluate.py scoring exactly what
  the run logged; a name torchvision does not have is one error line listing the choices, with nothing written.
- Augmentation (TrivialAugment, random erasing, mixup, cutmix, label smoothing) leaves training reproducible:
  torchrun with 2 loader workers per process and spawn with none end bitwise alike.
- --model-ema: the EMA is validated every epoch and saved in the checkpoint; best.pth holds whichever of the model
  and its EMA validated best (the earlier epoch, and the model, on a tie); a run stopped and resumed ends bitwise
  like an uninterrupted one, EMA included.
- --save-every keeps model-N.pth beside best.pth and last.pth and nothing more; --accumulate scales the learning
  rate, not the images an epoch trains on; a resumed run's recipe flags must be the checkpoint's; --warmup-epochs
  must leave an epoch to decay.
"""

import contextlib
import io
import json
import shutil

import pytest
import torch
from conftest import (
    DDP_FLAGS,
    FAST,
    assert_user_error,
    fault_env,
    final_weights,
    metrics_without_timings,
    run_here,
    run_script,
    torchrun,
)
from torchvision.models import get_model

import evaluate
import predict
from dataset.folders import read_split_data
from read_back import with_weights
from run.config import parse_config

MODELS = ["resnet18", "mobilenet_v3_small", "efficientnet_b0"]
AUGMENT = (
    *("--auto-augment", "trivialaugment", "--random-erase", "0.5", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"),
    *("--label-smoothing", "0.1"),
    *("--batches", "loader"),  # TrivialAugment and random erasing have no batched form on the device
)
EMA = ("--model", "resnet18", "--model-ema", "--ema-decay", "0.9", "--epochs", "2", *FAST)
# Retention and accumulation share one run: 3 epochs, model-1.pth kept, 2 micro-batches a step.
RETENTION = ("--model", "resnet18", "--epochs", "3", "--save-every", "2", "--accumulate", "2", *FAST)


def train(script: str, data, out, *flags, launcher=(), env=None):
    """A run that must succeed: the finished process. A single process without a fault runs in this one
    (run_here): what these tests check is the recipe's, not a new interpreter's start."""
    flags = ("--data-path", data, "--output-dir", out, *flags)
    if launcher or env or script != "train_single_gpu.py":
        result = run_script(script, *flags, launcher=launcher, env=env)
    else:
        result = run_here(script, *flags)
    assert result.returncode == 0, result.stderr
    return result


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoint(path) -> dict:
    return with_weights(torch.load(path, weights_only=True), path)  # a checkpoint's weights read from their files


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, different[:5]


def call(script_module, *argv) -> str:
    """A script's main called in this process with a command line (no interpreter start-up): what it prints.
    Fails the test if it stops with an error."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script_module.main([str(arg) for arg in argv])
    return printed.getvalue()


def tiny_split(tiny_data):
    """tiny_data split as a run with the default --val-rate and --seed splits it."""
    return read_split_data(tiny_data, 0.2, 0)


# --model ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=MODELS)
def model_run(request, tiny_data, tmp_path_factory):
    """One epoch of train_single_gpu.py --model NAME: (NAME, run folder)."""
    name = request.param
    out = tmp_path_factory.mktemp(name) / "run"
    train("train_single_gpu.py", tiny_data, out, "--epochs", "1", *FAST, "--model", name)
    return name, out


def test_each_model_trains_and_its_weights_load_strictly_into_torchvisions_model(model_run):
    name, out = model_run
    assert json.loads((out / "args.json").read_text())["model"] == name
    assert sorted(p.name for p in (out / "weights").iterdir()) == [".model-0.pth", "best.pth", "last.pth"]
    best, last = (checkpoint(out / "weights" / f) for f in ("best.pth", "last.pth"))
    for weights in (best, last):
        get_model(name, num_classes=5).load_state_dict(weights, strict=True)
    assert_same_tensors(best, last)  # one epoch: it is the best one
    assert checkpoint(out / "checkpoint.pth")["args"]["model"] == name


def test_predict_and_evaluate_score_each_models_best_weights_as_the_run_did(model_run, tiny_data, tmp_path):
    name, out = model_run
    (logged,) = metrics(out)  # the only epoch, so the best one
    split = tiny_split(tiny_data)
    weights = out / "weights" / "best.pth"

    printed = call(predict, *split.val_images, "--weights", weights)
    lines = printed.splitlines()
    assert [line.rsplit(": ", 1)[0] for line in lines] == split.val_images
    top = [line.rsplit(": ", 1)[1].split(", ")[0].rsplit(" ", 1)[0] for line in lines]
    assert all(len(line.rsplit(": ", 1)[1].split(", ")) == 3 for line in lines)
    truth = [split.classes[label] for label in split.val_labels]
    assert sum(p == t for p, t in zip(top, truth, strict=True)) == logged["val_correct"]

    printed = call(evaluate, "--weights", weights, "--output-dir", tmp_path / "eval")
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["accuracy"] == logged["val_acc"]
    assert (report["correct"], report["total"]) == (logged["val_correct"], logged["val_total"])
    assert f"accuracy {logged['val_acc']:.3f} ({logged['val_correct']}/{logged['val_total']})" in printed


def test_a_model_torchvision_does_not_have_is_one_line_listing_the_choices(tiny_data, tmp_path, run_main):
    out = tmp_path / "o"
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--model", "resnet35", "--output-dir", out)
    assert_user_error(result, "resnet35")
    assert "resnet34" in result.stderr and "efficientnet_b0" in result.stderr
    assert not out.exists()


# augmentation ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def augmented_ddp_runs(tiny_data, tmp_path_factory):
    """The same 2-process epoch with every augmentation option on, under torchrun with 2 loader workers per
    process and under spawn with none (images loaded in the training processes): run folders."""
    tmp = tmp_path_factory.mktemp("augmented_ddp")
    flags = (*DDP_FLAGS, *AUGMENT, "--epochs", "1")
    train(
        "train_multi_gpu_using_launch.py", tiny_data, tmp / "torchrun", *flags, "--workers", "2", launcher=torchrun(2)
    )
    train("train_multi_gpu_using_spawn.py", tiny_data, tmp / "spawn", "--world-size", "2", *flags, "--workers", "0")
    return tmp / "torchrun", tmp / "spawn"


@pytest.mark.guarantee
@pytest.mark.across_launchers
def test_augmented_runs_are_bitwise_identical_under_torchrun_and_spawn_whatever_the_loader_workers(
    augmented_ddp_runs,
):
    torchrun_out, spawn_out = augmented_ddp_runs
    recorded = json.loads((torchrun_out / "args.json").read_text())
    assert (recorded["auto_augment"], recorded["random_erase"], recorded["mixup_alpha"]) == ("trivialaugment", 0.5, 0.2)
    assert (recorded["cutmix_alpha"], recorded["label_smoothing"]) == (1.0, 0.1)
    assert (recorded["workers"], json.loads((spawn_out / "args.json").read_text())["workers"]) == (2, 0)
    assert_same_tensors(final_weights(torchrun_out), final_weights(spawn_out))
    assert metrics_without_timings(torchrun_out) == metrics_without_timings(spawn_out)
    assert [m["world_size"] for m in metrics(spawn_out)] == [2]


# --model-ema -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ema_runs(tiny_data, tmp_path_factory):
    """Two epochs with an EMA, uninterrupted; and the same run stopped at the start of epoch 1, then continued
    with --auto-resume. Returns (uninterrupted folder, resumed folder, folder holding the stopped run's
    checkpoint.pth and best.pth as epoch 0 left them)."""
    tmp = tmp_path_factory.mktemp("ema")
    train("train_single_gpu.py", tiny_data, tmp / "whole", *EMA)
    stopped = run_script(
        "train_single_gpu.py", "--data-path", tiny_data, "--output-dir", tmp / "resumed", *EMA,
        env=fault_env("raise:0:1"),
    )  # fmt: skip
    assert stopped.returncode != 0 and "injected failure on rank 0 at epoch 1" in stopped.stderr, stopped.stderr
    assert checkpoint(tmp / "resumed" / "checkpoint.pth")["epoch"] == 0
    shutil.copytree(tmp / "resumed" / "weights", tmp / "epoch0" / "weights")  # the files the checkpoint names
    for name in ("checkpoint.pth", "weights/best.pth"):
        shutil.copy(tmp / "resumed" / name, tmp / "epoch0")
    resumed = train("train_single_gpu.py", tiny_data, tmp / "resumed", *EMA, "--auto-resume")
    assert "Resuming from" in resumed.stdout
    return tmp / "whole", tmp / "resumed", tmp / "epoch0"


def test_the_ema_is_validated_each_epoch_and_saved_in_the_checkpoint(ema_runs):
    out = ema_runs[0]
    lines = metrics(out)
    assert [m["epoch"] for m in lines] == [0, 1]
    for m in lines:
        assert 0 <= m["ema_val_correct"] <= m["val_total"]
        assert m["ema_val_acc"] == m["ema_val_correct"] / m["val_total"]  # as val_acc is val_correct / val_total
    state = checkpoint(out / "checkpoint.pth")
    model = state["model"]
    ema = state["ema"]
    assert ema.keys() == {"n_averaged"} | {f"module.{key}" for key in model}
    steps = sum(m["train_images"] for m in lines) // 8  # one EMA update per optimizer step (batch 8)
    assert int(ema["n_averaged"]) == steps
    get_model("resnet18", num_classes=5).load_state_dict({k: ema[f"module.{k}"] for k in model}, strict=True)
    assert not torch.equal(ema["module.fc.weight"], model["fc.weight"])  # an average, not a copy


def test_best_pth_is_the_model_or_ema_that_validated_best(ema_runs):
    out, _, epoch0 = ema_runs
    lines = metrics(out)
    # The state after each epoch: epoch 0's from the stopped run (bitwise the same run up to there), epoch 1's from
    # the uninterrupted run; and best.pth as each left it.
    states = [checkpoint(epoch0 / "checkpoint.pth"), checkpoint(out / "checkpoint.pth")]
    bests = [checkpoint(epoch0 / "best.pth"), checkpoint(out / "weights" / "best.pth")]
    for last in (0, 1):
        # Each epoch scores the better of model and EMA (the model on a tie); best.pth is the one of the first epoch
        # with the top score so far.
        scores = [max(m["val_correct"], m["ema_val_correct"]) for m in lines[: last + 1]]
        best_epoch = scores.index(max(scores))
        state = states[best_epoch]
        if lines[best_epoch]["ema_val_correct"] > lines[best_epoch]["val_correct"]:
            expected = {key: state["ema"][f"module.{key}"] for key in state["model"]}
        else:
            expected = state["model"]
        assert_same_tensors(bests[last], expected)


@pytest.mark.guarantee
def test_a_stopped_and_resumed_ema_run_ends_bitwise_as_an_uninterrupted_one(ema_runs):
    whole, resumed, _ = ema_runs
    assert_same_tensors(final_weights(resumed), final_weights(whole))
    assert_same_tensors(checkpoint(resumed / "weights" / "best.pth"), checkpoint(whole / "weights" / "best.pth"))
    assert_same_tensors(checkpoint(resumed / "checkpoint.pth")["ema"], checkpoint(whole / "checkpoint.pth")["ema"])
    assert metrics_without_timings(resumed) == metrics_without_timings(whole)


# retention, accumulation, recipe checks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def retention_run(tiny_data, tmp_path_factory):
    """3 epochs with --save-every 2 and --accumulate 2: (run folder, finished process)."""
    out = tmp_path_factory.mktemp("retention") / "run"
    return out, train("train_single_gpu.py", tiny_data, out, *RETENTION)


def test_save_every_keeps_model_n_beside_best_and_last_and_nothing_more(retention_run):
    out, _ = retention_run
    names = ["best.pth", "last.pth", "model-1.pth", ".model-2.pth"]  # and the file the checkpoint names, hidden
    assert sorted(p.name for p in (out / "weights").iterdir()) == sorted(names)
    state = checkpoint(out / "checkpoint.pth")
    assert state["epoch"] == 2
    assert_same_tensors(final_weights(out), state["model"])
    kept = checkpoint(out / "weights" / "model-1.pth")
    get_model("resnet18", num_classes=5).load_state_dict(kept, strict=True)
    assert not torch.equal(kept["fc.weight"], state["model"]["fc.weight"])  # epoch 1's, not the last epoch's


def test_accumulate_scales_the_learning_rate_not_the_images_an_epoch_trains_on(retention_run, tiny_data):
    out, result = retention_run
    assert json.loads((out / "args.json").read_text())["accumulate"] == 2
    printed = [line for line in result.stdout.splitlines() if line.startswith("Learning rate")]
    assert printed == ["Learning rate 0.002 (--lr 0.001 x 1 process(es) x 2 batch(es)) for a global batch of 16"]
    lines = metrics(out)
    assert lines[0]["lr"] == pytest.approx(0.002)  # the full rate at the first step (no warmup)
    per_epoch = len(tiny_split(tiny_data).train_images) // 8 * 8  # the loader's batches x --batch-size
    assert [m["train_images"] for m in lines] == [per_epoch] * 3


def test_resuming_with_a_changed_recipe_flag_is_refused_naming_it(retention_run, tiny_data, run_main):
    out, _ = retention_run
    before = (out / "checkpoint.pth").read_bytes(), (out / "metrics.jsonl").read_text()
    result = run_main(
        "train_single_gpu.py", "--data-path", tiny_data, "--resume", out / "checkpoint.pth", *RETENTION,
        "--label-smoothing", "0.1",
    )  # fmt: skip
    assert_user_error(result, "--label-smoothing 0.0 (not 0.1)")
    assert "--epochs" not in result.stderr and "--accumulate" not in result.stderr  # only the flag that changed
    assert ((out / "checkpoint.pth").read_bytes(), (out / "metrics.jsonl").read_text()) == before


def test_warmup_must_leave_an_epoch_to_decay(tiny_data, tmp_path, run_main):
    out = tmp_path / "o"
    result = run_main(
        "train_single_gpu.py", "--data-path", tiny_data, "--epochs", "2", "--warmup-epochs", "2", "--output-dir", out
    )
    assert_user_error(result, "--warmup-epochs 2")
    assert "--epochs 2" in result.stderr
    assert not out.exists()
    assert parse_config("train_single_gpu", "", ["--epochs", "2", "--warmup-epochs", "1"]).warmup_epochs == 1
