"""A run's folder belongs to one run: a second run is refused while the first holds it, a crash leaves no lock
behind, and a resume continues the same run, on the same split of the data."""

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DDP_FLAGS, ROOT, STOPPED_FLAGS, assert_user_error, copy_run, run_here, run_script, torchrun
from filelock import FileLock

from dataset.demo import make_demo_data
from dataset.folders import DataSplit, split_fingerprint
from dataset.image_check import CHECK_LOCK, CHECKED_IMAGES
from multi_train_utils.checkpoint import load_checkpoint
from run.folder_lock import RUN_LOCK, held_run_folders, hold_run_folder
from run.plan import check_same_split
from utils import UserError


@contextlib.contextmanager
def holding(folder: Path):
    """This process holds `folder` as a run would (hold_run_folder), until the end of the with block."""
    hold_run_folder(folder)
    try:
        yield
    finally:
        held_run_folders.pop(folder.resolve()).release()


@contextlib.contextmanager
def held_by_another_run(folder: Path):
    """`folder` locked as another run's hold_run_folder locks it (a FileLock of its own on the folder's lock file;
    held_run_folders, this process's record of what it holds, does not list it), until the end of the with block:
    a script's main called in this process then finds it held, as a second run started from a shell does."""
    lock = FileLock(folder / RUN_LOCK, timeout=0)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def files_of(folder: Path) -> dict:
    """Every file of a run's folder (its lock file aside) with its bytes and modification time."""
    return {
        path.relative_to(folder): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file() and path.name != RUN_LOCK
    }


def test_a_run_into_a_folder_another_run_holds_is_refused_and_leaves_it_as_it_was(
    tiny_data, stopped_run, tmp_path, run_main
):
    out = copy_run(stopped_run, tmp_path)  # a run stopped after epoch 0
    before = files_of(out)
    flags = ("--data-path", tiny_data, *STOPPED_FLAGS, "--output-dir", out)
    with held_by_another_run(out):  # the refusals in this process: the same main and error line, no start-up
        for refused in (
            run_main("train_single_gpu.py", *flags),
            run_main("train_single_gpu.py", *flags, "--auto-resume"),
        ):
            assert_user_error(refused, f"{out} is in use by another run")
            assert "wait for that run to end, or choose another --output-dir" in refused.stderr
        assert files_of(out) == before

    resumed = run_here("train_single_gpu.py", *flags, "--auto-resume")  # released: the run continues
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 1


def test_under_torchrun_rank_0_alone_holds_the_folder_and_its_refusal_ends_the_job(tiny_data, tmp_path):
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, "--output-dir", out, *DDP_FLAGS, "--epochs", "1")
    with holding(out):
        refused = run_script("train_multi_gpu_using_launch.py", *flags, launcher=torchrun(2), timeout=120)
    assert refused.returncode != 0 and f"error: {out} is in use by another run" in refused.stderr
    # Nothing but the start-up image check's record (verdicts merged into any there: dataset/image_check.py),
    # which torchrun's ranks share before rank 0 holds the folder
    assert {path.name for path in out.iterdir()} <= {RUN_LOCK, CHECKED_IMAGES, CHECK_LOCK}

    # The corrected command is not refused for what the refusal left (a run of 2 that rank 1 takes no lock in:
    # torchrun_run); here in one process, the launch script started without torchrun
    ran = run_here("train_multi_gpu_using_launch.py", *flags)
    assert ran.returncode == 0, ran.stderr
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 0


def test_a_run_that_failed_before_its_first_epoch_ended_leaves_its_folder_to_the_corrected_command(
    tiny_data, tmp_path, monkeypatch, run_main
):
    script, out = importlib.import_module("train_single_gpu"), tmp_path / "run"
    flags = ("train_single_gpu.py", "--data-path", tiny_data, *STOPPED_FLAGS, "--output-dir", out)

    def out_of_memory(*args, **options):  # the first step's failure, a traceback, as a GPU too small gives it
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with monkeypatch.context() as first_step, pytest.raises(RuntimeError, match="out of memory"):
        first_step.setattr(script, "train_one_epoch", out_of_memory)
        run_here(*flags)
    left = {path.relative_to(out).parts[0] for path in out.iterdir()}
    assert {"args.json", "class_indices.json", "tb"} <= left and "metrics.jsonl" not in left

    corrected = run_here(*flags, "--batch-size", "4", "--epochs", "1")  # a smaller batch, in the same folder
    assert corrected.returncode == 0, corrected.stderr
    held = "(args.json, class_indices.json, tb/*): this run starts there anew"
    assert f"{out} held the start of a run that ended before its first epoch did {held}" in corrected.stdout
    assert json.loads((out / "args.json").read_text())["batch_size"] == 4 and len(list((out / "tb").iterdir())) == 1
    # once an epoch has ended, the folder is the run's: a new run is refused, --auto-resume continues it
    assert_user_error(run_main(*flags), "continue it with --auto-resume, or choose another --output-dir")


@pytest.mark.fast
def test_the_lock_of_a_run_folder_ends_with_the_process_that_held_it(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from run.folder_lock import "
         "hold_run_folder; hold_run_folder(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)",
         str(folder)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match="is in use by another run"):
            hold_run_folder(folder)
    finally:
        holder.kill()  # as a crash would: the holder never releases the lock itself
        holder.wait()
    with holding(folder):  # no stale lock to clean up
        assert (folder / RUN_LOCK).exists()


def test_a_resume_on_data_that_lost_or_gained_images_is_refused_and_one_on_moved_data_continues(
    tiny_data, stopped_run, tmp_path, run_main
):
    data, out = tmp_path / "data", copy_run(stopped_run, tmp_path)  # a run on tiny_data, stopped after epoch 0
    shutil.copytree(tiny_data, data)  # tiny_data is the whole session's: this test changes its own copy
    resume = ("train_single_gpu.py", *STOPPED_FLAGS, "--resume", out / "checkpoint.pth")

    lost = data / "daisy" / "daisy_0000.jpg"
    lost.rename(tmp_path / lost.name)
    changed = "was trained on another split of the data: 49 training images where the run had 50"  # of 60
    assert_user_error(run_main(*resume, "--data-path", data), changed)
    (tmp_path / lost.name).rename(lost)

    more = make_demo_data(tmp_path / "more", images_per_class=13, size=(48, 40))  # tiny_data's, and one more each
    gained = shutil.copy(more / "tulips" / "tulips_0012.jpg", data / "tulips")
    assert_user_error(run_main(*resume, "--data-path", data), "was trained on another split of the data: ")
    Path(gained).unlink()

    damaged = data / "roses" / "roses_0003.jpg"  # a file still there, broken since the run stopped
    original = damaged.read_bytes()
    damaged.write_bytes(original[:40])
    refused = run_main(*resume, "--data-path", data)
    assert_user_error(refused, f"1 of its files cannot be read ({damaged}): if the run read them, they were damaged")
    damaged.write_bytes(original)

    moved = data.rename(tmp_path / "moved")  # the same files, relative to the data folder
    resumed = run_here(*resume, "--data-path", moved)
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 1


def fingerprint_of(root: Path, pairs: list[tuple[str, int]], val: list[tuple[str, int]]) -> dict:
    images = lambda pairs: [str(root / name) for name, _ in pairs]  # noqa: E731
    labels = lambda pairs: [label for _, label in pairs]  # noqa: E731
    split = DataSplit(images(pairs), labels(pairs), images(val), labels(val), ["a", "b"])
    return split_fingerprint(split, root)


TRAIN = [("a/1.jpg", 0), ("a/2.jpg", 0), ("b/3.jpg", 1)]
VAL = [("a/4.jpg", 0), ("b/5.jpg", 1)]


@pytest.mark.fast
def test_the_split_fingerprint_depends_on_the_images_and_labels_not_their_order_nor_the_data_folder(tmp_path):
    fingerprint = fingerprint_of(tmp_path / "data", TRAIN, VAL)
    assert fingerprint_of(tmp_path / "data", TRAIN[::-1], VAL[::-1]) == fingerprint
    assert fingerprint_of(tmp_path / "elsewhere", TRAIN, VAL) == fingerprint
    assert fingerprint_of(tmp_path / "data", [*TRAIN[:2], ("b/3.jpg", 0)], VAL) != fingerprint  # another label
    assert fingerprint_of(tmp_path / "data", TRAIN, [*VAL, ("b/6.jpg", 1)]) != fingerprint
    assert (fingerprint["train_images"], fingerprint["val_images"]) == (3, 2)


@pytest.mark.fast
def test_a_changed_split_is_refused_naming_what_changed_and_a_checkpoint_without_one_is_accepted(tmp_path):
    checkpoint, run = tmp_path / "run" / "checkpoint.pth", fingerprint_of(tmp_path, TRAIN, VAL)
    fewer = fingerprint_of(tmp_path, TRAIN[:2], VAL)
    with pytest.raises(UserError, match="2 training images where the run had 3") as refused:
        check_same_split(checkpoint, run, fewer)
    assert "validation" not in str(refused.value)
    swapped = fingerprint_of(tmp_path, TRAIN, [("a/4.jpg", 0), ("b/6.jpg", 1)])
    with pytest.raises(UserError, match="2 validation images, not all the run's"):
        check_same_split(checkpoint, run, swapped)
    check_same_split(checkpoint, run, fingerprint_of(tmp_path, TRAIN, VAL))
    check_same_split(checkpoint, None, fewer)  # a run from before split fingerprints: resumed as before


def test_a_resume_into_another_runs_folder_is_refused_and_one_into_a_new_folder_leaves_its_own_run_alone(
    tiny_data, stopped_run, tmp_path, run_main
):
    own, other = copy_run(stopped_run, tmp_path), tmp_path / "other"
    shutil.copytree(stopped_run, other)
    (other / "checkpoint.pth").unlink()  # a run that crashed in its second epoch, without a checkpoint (args.json,
    (other / "metrics.jsonl").unlink()  # class_indices.json, weights, tb and the image check left)
    before, before_other = files_of(own), files_of(other)
    flags = ("--data-path", tiny_data, *STOPPED_FLAGS, "--resume", own / "checkpoint.pth")
    refused = run_main("train_single_gpu.py", *flags, "--output-dir", other)
    assert_user_error(refused, f"{other} already holds a run (args.json, class_indices.json, weights/*.pth, tb/*)")
    assert "in its own folder (leave out --output-dir) or into a new or empty one" in refused.stderr
    new_run = run_main("train_single_gpu.py", "--data-path", tiny_data, *STOPPED_FLAGS, "--output-dir", other)
    assert_user_error(new_run, "continue it with --auto-resume, or choose another --output-dir")
    assert files_of(own) == before and files_of(other) == before_other

    elsewhere = run_here("train_single_gpu.py", *flags, "--output-dir", tmp_path / "new")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert f"The run continues in {tmp_path / 'new'}, a folder of its own: {own} is left as it was" in elsewhere.stdout
    assert files_of(own) == before and load_checkpoint(tmp_path / "new" / "checkpoint.pth")["epoch"] == 1
