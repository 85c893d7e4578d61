"""Surviving the filesystem during a run: a disk that fills up while saving, images that vanish mid-run.

Both arrive after the start-up checks, through tests/fault_injection: the disk filling up is the kernel's own
file-size limit (RLIMIT_FSIZE: writes fail with EFBIG as they fail with ENOSPC on a full disk), no privileges
needed; images are deleted by rank 0 between or within epochs, as a cleaning job or a re-sync would.
"""

import json
import re
import shutil
import time

import pytest
import torch
from conftest import FAST, fault_env, processes_with, run_here, run_script, torchrun
from torch import nn

from dataset.folders import read_split_data
from dataset.images import SKIPPED
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.train_eval_utils import Training, evaluate, train_one_epoch
from utils import UserError

DISK_FULL_AT_EPOCH_1 = "fsize:1:1000000"  # from epoch 1 on, no file may pass 1 MB: the weights (tens of MB) cannot


def error_lines(stderr: str) -> set[str]:
    return {line for line in stderr.splitlines() if line.startswith("error:")}


def assert_stopped_cleanly_after_epoch(epoch: int, out, result, launcher: str | None = None) -> str:
    """One error line (every rank prints the same) and no traceback of ours (torchrun prints its own report of
    the processes that ended with status 2), the old checkpoint whole, no temporary file."""
    assert result.stderr.count("Traceback") == (result.stderr.count("ChildFailedError:") if launcher else 0), (
        result.stderr
    )
    (line,) = error_lines(result.stderr)
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == epoch  # the last whole epoch's, loadable
    assert not [path.name for path in out.rglob("*.tmp")]  # no temporary file left behind
    return line


def test_a_full_disk_while_saving_stops_the_run_in_one_line_and_resume_continues(tiny_data, tmp_path):
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, "--output-dir", out, "--epochs", "2", *FAST)
    result = run_script("train_single_gpu.py", *flags, env=fault_env(DISK_FULL_AT_EPOCH_1))
    assert result.returncode == 2, result.stderr
    line = assert_stopped_cleanly_after_epoch(0, out, result)
    assert f"cannot write {out / 'weights' / 'last.pth'}: File too large" in line
    assert re.search(r"\d+ MiB free on its filesystem, about \d+ MiB needed", line), line
    assert f"{out / 'checkpoint.pth'} (epoch 0) is untouched" in line
    advised = line.split(f"once {out} can be written, run the same command with ")[1].split()

    resumed = run_here("train_single_gpu.py", *flags, *advised)  # once there is room
    assert resumed.returncode == 0 and "Resuming from" in resumed.stdout, resumed.stderr
    assert [json.loads(m)["epoch"] for m in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def copy_of(data, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    return copy, read_split_data(copy, seed=3)


# The images read from their files every epoch, as without an image store: a file that vanishes after the store
# was built changes nothing
FROM_FILES = ("--store-dir", "off", "--batches", "loader")


def test_under_torchrun_vanished_images_are_skipped_on_every_rank_and_a_full_disk_stops_them_all(tiny_data, tmp_path):
    data, split = copy_of(tiny_data, tmp_path)
    gone = [split.train_images[0], split.val_images[0]]
    # Two images deleted after one step of epoch 1; from epoch 2 on, the disk is full.
    env = {**fault_env("delete:1:1,fsize:2:1000000"), "FAULT_FILES": ":".join(gone)}
    out = tmp_path / "run"
    flags = (
        "--data-path",
        data,
        "--output-dir",
        out,
        "--epochs",
        "4",
        "--device",
        "cpu",
        "--seed",
        "3",
        *FAST,
        *FROM_FILES,
    )
    started = time.monotonic()
    result = run_script("train_multi_gpu_using_launch.py", *flags, launcher=torchrun(2), env=env, timeout=180)
    assert result.returncode != 0

    # Epochs 0 and 1 ran to the end, the vanished images skipped with a warning and counted.
    assert f"warning: skipped unreadable image {gone[1]}" in result.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["val_skipped_images"] for m in metrics[:2]] == [0, 1]
    assert [m["val_total"] for m in metrics[:2]] == [len(split.val_images), len(split.val_images) - 1]
    # Every step of every rank took place (2 ranks x 3 steps of 8): the images read and the images skipped make
    # up each epoch; the deleted training image is skipped if the shuffle puts it in the epoch's steps.
    assert all(m["train_images"] + m["skipped_images"] == 2 * 3 * 8 for m in metrics)
    assert metrics[0]["skipped_images"] == 0 and metrics[1]["skipped_images"] <= 1
    warned = f"warning: skipped unreadable image {gone[0]}" in result.stderr
    assert warned == (sum(m["skipped_images"] for m in metrics) > 0)

    # Epoch 2's weights could not be written: both ranks stopped on it, promptly, with epoch 1's checkpoint kept.
    line = assert_stopped_cleanly_after_epoch(1, out, result, launcher="torchrun")
    assert f"cannot write {out / 'weights' / 'last.pth'}: File too large" in line
    assert result.stderr.count("error: cannot write") == 2  # both ranks, not one rank and a timeout
    assert time.monotonic() - started < 120 and not processes_with(env["RUN_MARKER"])


def test_more_unreadable_images_than_one_percent_stop_the_run_in_one_line(tiny_data, tmp_path):
    data, split = copy_of(tiny_data, tmp_path)
    env = {**fault_env("delete:1:0"), "FAULT_FILES": ":".join(split.train_images[:20])}  # between epochs 0 and 1
    out = tmp_path / "run"
    flags = ("--data-path", data, "--output-dir", out, "--epochs", "3", "--seed", "3", *FAST, *FROM_FILES)
    result = run_script("train_single_gpu.py", *flags, env=env)
    assert result.returncode == 2, result.stderr
    (line,) = error_lines(result.stderr)
    assert "of epoch 1's training images could not be read, more than the 1 (1 %)" in line
    assert "Traceback" not in result.stderr
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 0


class Batches(list):
    """Batches of a loader, over a dataset of `size` images."""

    def __init__(self, batches, size):
        super().__init__(batches)
        self.dataset = range(size)


def tiny_network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 3))


def batch(labels):
    return torch.randn(len(labels), 3, 4, 4), torch.tensor(labels)


@pytest.mark.fast
def test_skipped_images_leave_the_loss_and_the_counts_and_stop_a_strict_run():
    model = tiny_network()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = batch([0, 1, 2, 1])
    with_skip = (images, torch.tensor([0, SKIPPED, 2, 1]))
    loss, trained = train_one_epoch(Training(model, optimizer), [with_skip], "cpu", 0)
    expected = nn.functional.cross_entropy(tiny_network()(images[[0, 2, 3]]), torch.tensor([0, 2, 1]))
    assert trained == 3 and abs(loss - expected.item()) < 1e-6  # the skipped image is not in the loss
    # A batch of nothing but skipped images still takes its step (the ranks step together) and moves nothing.
    before = [p.clone() for p in model.parameters()]
    train_one_epoch(Training(model, torch.optim.SGD(model.parameters(), lr=0.1)), [batch([SKIPPED] * 2)], "cpu", 0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(UserError, match=r"\(--strict-images\)"):
        train_one_epoch(Training(model, optimizer), [with_skip], "cpu", 0, max_skipped=0)

    confusion = evaluate(model, Batches([batch([0, SKIPPED, 2])], 3), "cpu", 3, max_skipped=1)
    assert int(confusion.sum()) == 2  # the skipped image counts neither as right nor as wrong
    with pytest.raises(UserError, match="2 of the validation images could not be read"):
        evaluate(model, Batches([batch([SKIPPED, SKIPPED, 2])], 3), "cpu", 3, max_skipped=1)
