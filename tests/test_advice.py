"""Every command a message advises, run in the situation that prints it: it works.

Each row of ADVICE makes a situation, takes the advice from the line the program prints there (the flags as printed,
not as the test would guess them) and follows it. A refusal is followed as far as the run goes once nothing refuses
it: through every check of train_single_gpu.py (run/plan.py's prepare, the device) with its training left out
(`starts`); an advice given once a run has trained (a write that failed, out of memory, a stop, Ctrl-C, a non-finite
loss) is followed by a run that trains to its end. Advice this machine cannot put to the test is listed in
NOT_RUN_HERE, with why.
"""

import contextlib
import errno
import functools
import importlib
import json
import os
import re
import shutil
import signal
import types
from pathlib import Path
from urllib.error import URLError

import pytest
import torch
from conftest import STOPPED_FLAGS, copy_run, run_here
from filelock import FileLock
from test_micro_batch import SmallMemory

import run.plan
from multi_train_utils import checkpoint
from multi_train_utils.checkpoint import load_checkpoint
from run.config import SINGLE, parse_config
from run.folder_lock import RUN_LOCK
from utils import write_atomically

# Advice whose situation this machine cannot make, or whose following is not a command of this project
NOT_RUN_HERE = {
    "--device cuda on a machine with no GPU: use --device cpu": "run where no GPU is visible (the CPU machines)",
    "--dist-backend nccl where torch has no NCCL: use --dist-backend gloo": "a torch without NCCL (Windows, macOS)",
    "not even one image fits in the memory of a GPU: a smaller --img-size, --grad-checkpointing, another device":
        "a GPU's memory; the micro-batch that fits is followed below (out of memory while training)",
    "in DDP each process takes the GPU of its local rank: use --device cuda and CUDA_VISIBLE_DEVICES": "two GPUs",
    "predict.py --world-size under torchrun: --nproc_per_node says how many": "torchrun's own flag",
    "export.py: pip install onnx onnxscript onnxruntime": "pip, not this project's command",
    "timm's or torchvision's pretrained weights cannot be downloaded: fetch URL and give it as --weights FILE":
        "followed below for torchvision's (the file put where the message says); timm's needs the network",
    "autotune's cache: delete it, or pass --remeasure, to measure again": "tests/test_micro_batch.py measures again",
    "a tracker that failed: a resume of the run logs the epochs the tracker missed": "tests/test_tracking.py",
}  # fmt: skip


def error_line(result) -> str:
    """The one line a refusal prints (exit status 2, no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


def advised(line: str, before: str) -> list[str]:
    """The flags `line` advises after the words `before`, as printed: up to the next ")", ";", "," or the end."""
    assert before in line, line
    return re.split(r"[);,]", line.split(before, 1)[1])[0].split()


@contextlib.contextmanager
def without_training():
    """train_single_gpu.py as far as its training: every check, the folder held; `plans` holds what it prepared."""
    script, plans = importlib.import_module("train_single_gpu"), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(script, "train", lambda config, plan, process: plans.append(plan))
        yield plans


def starts(*flags):
    """train_single_gpu.py with `flags`, not refused: the plan it trains by (its training left out)."""
    with without_training() as plans:
        result = run_here("train_single_gpu.py", *flags)
    assert result.returncode == 0 and plans, result.stderr
    return plans[0]


class Situation(types.SimpleNamespace):
    """What a row works with: the data (`data`), a folder of its own (`tmp`), the suite's run stopped after its first
    of 2 epochs (`stopped`), and the script's flags for that run; `run`, a copy of it (made when first asked for),
    `checkpoint` and `best` in that copy."""

    @functools.cached_property
    def run(self) -> Path:
        return copy_run(self.stopped, self.tmp)

    @property
    def checkpoint(self) -> Path:
        return self.run / "checkpoint.pth"

    @property
    def best(self) -> Path:
        return self.run / "weights" / "best.pth"

    def flags(self, *more) -> tuple:
        return ("--data-path", self.data, *STOPPED_FLAGS, *more)

    def refused(self, *flags) -> str:
        return error_line(run_here("train_single_gpu.py", *flags))


# Refusals before training: followed as far as the training


def a_new_run_into_a_folder_holding_a_run(s: Situation) -> None:
    line = s.refused(*s.flags("--output-dir", s.run))
    assert starts(*s.flags("--output-dir", s.run, *advised(line, "continue it with "))).resume == s.checkpoint
    another = advised(line, "or choose another ")
    assert another == ["--output-dir"] and starts(*s.flags(*another, s.tmp / "new")).output_dir == s.tmp / "new"


def a_resume_into_another_runs_folder(s: Situation) -> None:
    other = Path(shutil.copytree(s.run, s.tmp / "other"))
    line = s.refused(*s.flags("--resume", s.checkpoint, "--output-dir", other))
    assert f"resume {s.checkpoint} in its own folder (leave out --output-dir) or into a new or empty one" in line
    assert starts(*s.flags("--resume", s.checkpoint)).output_dir == s.run
    assert starts(*s.flags("--resume", s.checkpoint, "--output-dir", s.tmp / "new")).output_dir == s.tmp / "new"


def auto_resume_in_a_folder_whose_epochs_ended_but_lost_its_checkpoint(s: Situation) -> None:
    metrics = s.run / "metrics.jsonl"
    epoch_0 = metrics.read_text()
    metrics.write_text(epoch_0 + epoch_0.replace('"epoch": 0', '"epoch": 1'))  # a run of 2 epochs, ended
    s.checkpoint.unlink()  # (removed to save room)
    line = s.refused(*s.flags("--auto-resume", "--output-dir", s.run))
    assert advised(line, "to continue from: choose another ") == ["--output-dir"]
    assert starts(*s.flags("--auto-resume", "--output-dir", s.tmp / "new")).resume is None


def a_folder_another_live_run_holds(s: Situation) -> None:
    lock = FileLock(s.run / RUN_LOCK, timeout=0)
    with lock:  # as another process's hold_run_folder holds it
        line = s.refused(*s.flags("--auto-resume", "--output-dir", s.run))
        assert advised(line, "or choose another ") == ["--output-dir"]
        starts(*s.flags("--auto-resume", "--output-dir", s.tmp / "new"))
    assert "wait for that run to end" in line and starts(*s.flags("--auto-resume", "--output-dir", s.run)).resume


def a_run_lock_that_is_a_folder(s: Situation) -> None:
    (s.run / RUN_LOCK).unlink(missing_ok=True)  # (the stopped run's, left behind)
    (s.run / RUN_LOCK).mkdir()
    line = s.refused(*s.flags("--auto-resume", "--output-dir", s.run))
    assert f"if no run is using {s.run}, remove it and run again" in line
    (s.run / RUN_LOCK).rmdir()
    assert starts(*s.flags("--auto-resume", "--output-dir", s.run)).resume == s.checkpoint


def an_image_check_lock_that_is_a_folder(s: Situation, monkeypatch) -> None:
    # under torchrun (its variables), rank 0 of 2 takes the lock the ranks share to check the images, where no image
    # store checks them (--store-dir off: a store decodes them under its own lock, in the store's folder)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    out = s.tmp / "new"
    config = parse_config(SINGLE, "", [str(flag) for flag in s.flags("--output-dir", out, "--store-dir", "off")])
    (out / ".checked_images.lock").mkdir(parents=True)
    with pytest.raises(run.plan.UserError, match="remove it and run again"):
        run.plan.prepare(config, world_size=2)
    (out / ".checked_images.lock").rmdir()
    assert run.plan.prepare(config, world_size=2)[1].output_dir == out


def a_resume_with_another_recipe_flag(s: Situation) -> None:
    line = s.refused(*s.flags("--resume", s.checkpoint, "--epochs", "3"))
    config = advised(line, "resume with the run's own flags (")
    assert config == ["--config", str(s.run / "args.json"), "gives", "them"]
    assert starts("--data-path", s.data, "--resume", s.checkpoint, *config[:2]).resume == s.checkpoint
    weights = advised(line, "or start a new run from its weights (")
    assert starts(*s.flags("--epochs", "3", *weights, "--output-dir", s.tmp / "new")).weights == s.best


def a_resume_as_another_model(s: Situation) -> None:
    line = s.refused(*s.flags("--resume", s.checkpoint, "--model", "resnet34"))
    config = advised(line, "resume it with the run's own flags (")[:2]
    assert starts("--data-path", s.data, "--resume", s.checkpoint, *config).resume == s.checkpoint
    assert "or start a new resnet34 run without its weights" in line
    new = starts(*s.flags("--model", "resnet34", "--output-dir", s.tmp / "new"))
    assert new.resume is None and new.weights is None


def a_resume_on_data_that_lost_an_image(s: Situation) -> None:
    data = Path(shutil.copytree(s.data, s.tmp / "data"))
    next((data / "daisy").iterdir()).unlink()
    line = s.refused(*s.flags("--resume", s.checkpoint, "--data-path", data))
    assert "resume with the run's data" in line and starts(*s.flags("--resume", s.checkpoint)).resume
    weights = advised(line, "or start a new run from its weights (")
    assert starts(*s.flags("--data-path", data, *weights, "--output-dir", s.tmp / "new")).weights == s.best


def a_resume_on_an_image_damaged_since(s: Situation) -> None:
    data = Path(shutil.copytree(s.data, s.tmp / "data"))
    image = next((data / "roses").iterdir())
    original = image.read_bytes()
    image.write_bytes(original[:40])
    line = s.refused(*s.flags("--resume", s.checkpoint, "--data-path", data))
    assert line.endswith("put back readable copies and resume")
    image.write_bytes(original)
    assert starts(*s.flags("--resume", s.checkpoint, "--data-path", data)).resume == s.checkpoint


def a_resume_on_processes_that_cannot_share_its_batch(s: Situation) -> None:
    config = parse_config(SINGLE, "", [str(flag) for flag in s.flags("--resume", s.checkpoint)])
    with pytest.raises(run.plan.UserError) as refused:
        run.plan.prepare(config, world_size=3)
    processes = int(advised(str(refused.value), "resume on a number of processes that divides ")[0])
    assert processes == 8 and run.plan.prepare(config, world_size=2)[0].batch_size == 4


def auto_resume_without_an_output_folder(s: Situation) -> None:
    line = s.refused(*s.flags("--auto-resume"))
    assert line.startswith("error: --auto-resume needs --output-dir: ")
    assert starts(*s.flags("--auto-resume", "--output-dir", s.run)).resume == s.checkpoint


def a_damaged_checkpoint(s: Situation) -> None:
    state = torch.load(s.checkpoint, weights_only=True)
    torch.save(state | {"best_acc": "high"}, s.checkpoint)  # an entry of another type
    line = s.refused(*s.flags("--resume", s.checkpoint))
    weights = advised(line, "or start a new run from its weights (")
    assert starts(*s.flags(*weights, "--output-dir", s.tmp / "new")).weights == s.best


def weights_given_as_a_checkpoint(s: Situation) -> None:
    line = s.refused(*s.flags("--resume", s.best))
    assert line.endswith("(weights only? use --weights)")
    assert starts(*s.flags("--weights", s.best, "--output-dir", s.tmp / "new")).weights == s.best


def a_damaged_record_of_the_epochs(s: Situation) -> None:
    metrics = s.run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + "{not json\n")
    line = s.refused(*s.flags("--auto-resume", "--output-dir", s.run))
    assert line.endswith("mend it (a JSON object a line, each with its epoch), then run again")
    metrics.write_text(good)
    assert starts(*s.flags("--auto-resume", "--output-dir", s.run)).resume == s.checkpoint


def no_data(s: Situation, monkeypatch) -> None:
    line = s.refused(*STOPPED_FLAGS, "--output-dir", s.tmp / "new")
    assert line.endswith("no data: give --data-path FOLDER (one sub-folder per class) or --demo"), line
    assert starts(*STOPPED_FLAGS, "--data-path", s.data, "--output-dir", s.tmp / "new").data_path == s.data
    monkeypatch.setattr(run.plan, "DEMO_DATA_PATH", s.tmp / "demo")  # (not the project's data folder)
    assert starts(*STOPPED_FLAGS, "--demo", "--output-dir", s.tmp / "demo-run").data_path == s.tmp / "demo"


def a_device_that_is_not_one(s: Situation) -> None:
    for device in ("tpu0", "mps"):  # not a device; a Mac's GPU, not on this machine
        line = s.refused(*s.flags("--device", device, "--output-dir", s.tmp / "new"))
        assert line.endswith("; use --device cpu") or line.endswith(": use cpu, cuda, cuda:N or mps"), line
    starts(*s.flags("--device", "cpu", "--output-dir", s.tmp / "new"))


def a_model_that_cannot_take_the_image_size(s: Situation) -> None:
    line = s.refused(*s.flags("--model", "vit_b_16", "--output-dir", s.tmp / "new"))
    size = re.search(r"Expected (\d+)", line)[1]  # torchvision's words, which the line passes on
    assert starts(*s.flags("--model", "vit_b_16", "--img-size", size, "--output-dir", s.tmp / "new")).resume is None


def weights_of_another_model(s: Situation) -> None:
    line = s.refused(*s.flags("--model", "resnet34", "--weights", s.best, "--output-dir", s.tmp / "new"))
    theirs = advised(line, "train resnet18 from them (")
    assert starts(*s.flags(*theirs, "--weights", s.best, "--output-dir", s.tmp / "new")).weights == s.best
    assert "or resnet34 from other weights (--weights imagenet, or none)" in line
    assert starts(*s.flags("--model", "resnet34", "--output-dir", s.tmp / "none")).weights is None


def imagenet_weights_that_cannot_be_downloaded(s: Situation, monkeypatch) -> None:
    def no_network(*args, **options):
        raise URLError("no network here")

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(s.tmp / "hub"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    line = s.refused(*s.flags("--weights", "imagenet", "--output-dir", s.tmp / "new"))
    path = Path(advised(line, " and put it at ")[0])
    torch.save(importlib.import_module("torchvision").models.resnet18().state_dict(), path)  # (its 1000 classes)
    assert starts(*s.flags("--weights", "imagenet", "--output-dir", s.tmp / "new")).weights == path


def flags_that_do_not_parse(s: Situation) -> None:
    line = s.refused(*s.flags("--epochs", "two"))
    assert re.search(r"\(see \S+ --help\)$", line), line  # (the program's name: pytest's here, in this process)
    with without_training():
        helped = run_here("train_single_gpu.py", "--help")
    assert helped.returncode == 0 and "--epochs" in helped.stdout


# predict.py, evaluate.py, plot_results.py: their refusals, followed to the end


def predicted(*flags) -> None:
    result = run_here("predict.py", *flags)
    assert result.returncode == 0, result.stderr


def results_that_exist(s: Situation) -> None:
    images, results, best = s.data / "daisy", s.tmp / "results.csv", s.stopped / "weights" / "best.pth"
    results.write_text("an earlier file\n")
    line = error_line(run_here("predict.py", images, "--weights", best, "--results", results))
    assert f"name another --results, or pass {advised(line, 'or pass ')[0]} to replace it" in line
    predicted(images, "--weights", best, "--results", results, "--force")
    assert results.read_text().startswith("path,")


def results_named_as_a_file_of_the_run(s: Situation) -> None:
    images, best = s.data / "daisy", s.stopped / "weights" / "best.pth"
    line = error_line(run_here("predict.py", images, "--weights", best, "--results", s.stopped / "metrics.jsonl"))
    assert line.endswith(": name another")
    predicted(images, "--weights", best, "--results", s.tmp / "results.jsonl")


def results_named_as_a_folder(s: Situation) -> None:
    images, best, folder = s.data / "daisy", s.stopped / "weights" / "best.pth", s.tmp / "results.csv"
    folder.mkdir()
    line = error_line(run_here("predict.py", images, "--weights", best, "--results", folder))
    assert line.endswith("is a folder: name a file")
    predicted(images, "--weights", best, "--results", folder / "results.csv")


def weights_without_their_class_names(s: Situation) -> None:
    alone = Path(shutil.copy(s.stopped / "weights" / "best.pth", s.tmp / "best.pth"))
    line = error_line(run_here("predict.py", s.data / "daisy", "--weights", alone))
    indices = advised(line, "; pass ")
    assert indices == ["--class-indices", "RUN/class_indices.json"]  # the folder of the run they came from
    assert line.endswith("and the run's --model and --img-size where they are not the defaults")
    run_flags = ("--model", "resnet18", "--img-size", "32")  # (STOPPED_FLAGS')
    predicted(s.data / "daisy", "--weights", alone, indices[0], s.stopped / "class_indices.json", *run_flags)


def a_model_that_is_not_the_runs(s: Situation) -> None:
    best = s.stopped / "weights" / "best.pth"
    line = error_line(run_here("predict.py", s.data / "daisy", "--weights", best, "--model", "resnet34"))
    assert "leave out --model (the run's resnet18 is used)" in line
    predicted(s.data / "daisy", "--weights", best)


def a_run_whose_data_folder_moved(s: Situation) -> None:
    args = json.loads((s.run / "args.json").read_text())
    (s.run / "args.json").write_text(json.dumps(args | {"data_path": str(s.tmp / "moved")}))
    line = error_line(run_here("evaluate.py", "--weights", s.best, "--output-dir", s.tmp / "eval"))
    assert line.endswith(": give --data-path")
    result = run_here("evaluate.py", "--weights", s.best, "--output-dir", s.tmp / "eval", "--data-path", s.data)
    assert result.returncode == 0 and (s.tmp / "eval" / "eval.json").exists(), result.stderr


def a_plot_named_as_a_folder(s: Situation) -> None:
    (s.tmp / "curves.png").mkdir()
    line = error_line(run_here("plot_results.py", s.stopped, "--output", s.tmp / "curves.png"))
    assert line.endswith("is a folder; name the PNG file")
    result = run_here("plot_results.py", s.stopped, "--output", s.tmp / "curves.png" / "curves.png")
    assert result.returncode == 0 and (s.tmp / "curves.png" / "curves.png").is_file(), result.stderr


def a_benchmark_folder_that_holds_one(s: Situation, monkeypatch) -> None:
    benchmark = importlib.import_module("tools.benchmark")
    monkeypatch.setenv(importlib.import_module("autotune.remembered").CACHE_ENV, "")  # settle names the benchmark's
    (s.tmp / "bench" / "runs").mkdir(parents=True)
    line = error_line(run_here("tools/benchmark.py", "--data-path", s.data, "--output-dir", s.tmp / "bench"))
    another = advised(line, "choose another ")
    assert another == ["--output-dir", "or", "remove", "it"]
    for output_dir in (s.tmp / "other", s.tmp / "bench"):  # another, or the one removed
        shutil.rmtree(s.tmp / "bench", ignore_errors=True)
        args = benchmark.parse_args(["--data-path", str(s.data), another[0], str(output_dir), "--device", "cpu"])
        benchmark.settle(args)  # (what main checks before it measures)


REFUSALS = [
    a_new_run_into_a_folder_holding_a_run, a_resume_into_another_runs_folder,
    auto_resume_in_a_folder_whose_epochs_ended_but_lost_its_checkpoint, a_folder_another_live_run_holds,
    a_run_lock_that_is_a_folder, an_image_check_lock_that_is_a_folder, a_resume_with_another_recipe_flag,
    a_resume_as_another_model, a_resume_on_data_that_lost_an_image, a_resume_on_an_image_damaged_since,
    a_resume_on_processes_that_cannot_share_its_batch, auto_resume_without_an_output_folder, a_damaged_checkpoint,
    weights_given_as_a_checkpoint, a_damaged_record_of_the_epochs, no_data, a_device_that_is_not_one,
    a_model_that_cannot_take_the_image_size, weights_of_another_model, imagenet_weights_that_cannot_be_downloaded,
    flags_that_do_not_parse, results_that_exist, results_named_as_a_file_of_the_run, results_named_as_a_folder,
    weights_without_their_class_names, a_model_that_is_not_the_runs, a_run_whose_data_folder_moved,
    a_plot_named_as_a_folder, a_benchmark_folder_that_holds_one,
]  # fmt: skip


@pytest.fixture
def situation(tiny_data, stopped_run, tmp_path) -> Situation:
    return Situation(data=tiny_data, stopped=stopped_run, tmp=tmp_path)


@pytest.mark.parametrize("refusal", REFUSALS, ids=[row.__name__ for row in REFUSALS])
def test_the_command_a_refusal_advises_is_not_refused(refusal, situation, monkeypatch):
    if "monkeypatch" in refusal.__code__.co_varnames:
        refusal(situation, monkeypatch)
    else:
        refusal(situation)


# Advice once a run has trained: followed by a run that trains to its end


def a_full_disk_as_the_first_epoch_saves(s: Situation, monkeypatch) -> None:
    """The issue's case: the first epoch's metrics and weights written, its checkpoint not (the disk full)."""
    out = s.tmp / "new"
    flags = (*s.flags("--epochs", "1"), "--output-dir", out)
    real_save = checkpoint.save_atomically

    def full_disk_for_the_checkpoint(state, path):
        if Path(path).name != "checkpoint.pth":
            return real_save(state, path)
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_atomically(path, lambda file: (_ for _ in ()).throw(full), binary=True)  # the real write, refused

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_atomically", full_disk_for_the_checkpoint)
        line = error_line(run_here("train_single_gpu.py", *flags))
    assert f"cannot write {out / 'checkpoint.pth'}: No space left on device" in line and "holds no checkpoint" in line
    assert (out / "metrics.jsonl").exists() and (out / "weights" / "last.pth").exists()
    assert "continue it with --auto-resume" in s.refused(*flags)  # the same command, as a new run: refused
    again = run_here("train_single_gpu.py", *flags, *advised(line, "run the same command with "))
    assert again.returncode == 0, again.stderr
    assert (
        f"{out} held a start that saved no checkpoint (metrics.jsonl, weights/*.pth): it starts again" in again.stdout
    )
    assert [json.loads(epoch)["epoch"] for epoch in (out / "metrics.jsonl").read_text().splitlines()] == [0]


def out_of_memory_in_the_first_epoch(s: Situation, monkeypatch) -> None:
    out = s.tmp / "new"
    flags = (*s.flags("--epochs", "1", "--micro-batch", "8"), "--output-dir", out)
    SmallMemory(monkeypatch)  # a device whose memory takes passes of 3 images
    line = error_line(run_here("train_single_gpu.py", *flags))
    fits = re.search(r"(--micro-batch \d+) fits now", line)[1].split()
    continuing = advised(line, "then run the same command with ")
    assert continuing[-3:] == ["and", "that", "flag"]
    again = run_here("train_single_gpu.py", *flags, *continuing[:-3], *fits)
    assert again.returncode == 0 and load_checkpoint(out / "checkpoint.pth")["epoch"] == 0, again.stderr


def a_stop_signal_to_a_run_without_an_output_folder(s: Situation, monkeypatch) -> None:
    monkeypatch.chdir(s.tmp)  # where the run makes its folder, runs/train_single_gpu-TIME
    script, flags = importlib.import_module("train_single_gpu"), s.flags("--epochs", "1")
    real_train_one_epoch = script.train_one_epoch

    def signalled(*args, **options):  # as SLURM's --signal would: noted, the run stops at a step and saves it
        os.kill(os.getpid(), signal.SIGUSR1)
        return real_train_one_epoch(*args, **options)

    with monkeypatch.context() as patch:
        patch.setattr(script, "train_one_epoch", signalled)
        stopped = run_here("train_single_gpu.py", *flags)
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr
    (line,) = [line for line in stopped.stdout.splitlines() if "to continue from this step" in line]
    again = run_here("train_single_gpu.py", *flags, *advised(line, "run the same command with "))
    assert again.returncode == 0 and "Resuming from" in again.stdout, again.stderr
    (run_folder,) = (s.tmp / "runs").iterdir()
    assert load_checkpoint(run_folder / "checkpoint.pth").get("midway") is None  # the epoch ended


def ctrl_c_while_training(s: Situation, monkeypatch) -> None:
    script, flags = importlib.import_module("train_single_gpu"), s.flags("--auto-resume", "--output-dir", s.run)

    def interrupted(*args, **options):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(script, "train_one_epoch", interrupted)
        stopped = run_here("train_single_gpu.py", *flags)
    assert stopped.returncode == 130, stopped.stderr
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("interrupted")]
    assert line.startswith(f"interrupted: {s.checkpoint} is whole; to go on, run the same command with ")
    again = run_here("train_single_gpu.py", *flags, *advised(line, "run the same command with "))
    assert again.returncode == 0 and load_checkpoint(s.checkpoint)["epoch"] == 1, again.stderr


def a_non_finite_loss(s: Situation, monkeypatch) -> None:
    script, flags = importlib.import_module("train_single_gpu"), s.flags("--auto-resume", "--output-dir", s.run)
    real_train_one_epoch = script.train_one_epoch

    def not_a_number(training, data_loader, *args, **options):  # epoch 1's images NaN: its loss too
        batches = [(images * torch.nan, labels) for images, labels in data_loader]
        return real_train_one_epoch(training, batches, *args, **options)

    with monkeypatch.context() as patch:
        patch.setattr(script, "train_one_epoch", not_a_number)
        line = error_line(run_here("train_single_gpu.py", *flags))
    assert line.startswith("error: non-finite loss at epoch 1: stopped")
    lr, weights, another = re.search(
        r"start a new run with a lower (--lr), from (--weights \S+) into another (\S+)$", line
    ).groups()
    new_run = s.flags(lr, "0.0005", *weights.split(), another, s.tmp / "new", "--epochs", "1")
    again = run_here("train_single_gpu.py", *new_run)
    assert again.returncode == 0 and load_checkpoint(s.tmp / "new" / "checkpoint.pth")["epoch"] == 0, again.stderr


TRAINED = [a_full_disk_as_the_first_epoch_saves, out_of_memory_in_the_first_epoch,
           a_stop_signal_to_a_run_without_an_output_folder, ctrl_c_while_training, a_non_finite_loss]  # fmt: skip


@pytest.mark.parametrize("stopped_by", TRAINED, ids=[row.__name__ for row in TRAINED])
def test_the_command_a_stopped_run_advises_trains_it_to_its_end(stopped_by, situation, monkeypatch):
    stopped_by(situation, monkeypatch)
