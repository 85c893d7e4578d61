"""The three scripts end to end, run as a user runs them: what they print, exit with and write."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    DDP_FLAGS,
    DDP_MODEL,
    FAST,
    PINNED_COMPUTE,
    REFERENCE_FLAGS,
    assert_user_error,
    final_weights,
    metrics_without_timings,
    run_here,
    run_script,
    torchrun,
)
from PIL import Image

from network.architectures import create_model

METRIC_KEYS = {
    "epoch",
    "train_loss",
    "val_acc",
    "lr",
    "epoch_seconds",
    "train_images_per_sec",
    "world_size",
    "peak_rss_mib",
}


def assert_run_outputs(out, epochs: int, world_size: int, num_classes: int = 5, model: str = "resnet18"):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == list(range(epochs))
    for m in lines:
        assert METRIC_KEYS <= m.keys()
        assert m["world_size"] == world_size
        assert 0.0 <= m["val_acc"] <= 1.0 and m["train_loss"] > 0 and m["train_images_per_sec"] > 0
    assert len(json.loads((out / "class_indices.json").read_text())) == num_classes
    assert list((out / "tb").glob("events.out.tfevents.*"))
    # Retention: the best and the last epoch's weights (and, hidden, the file the checkpoint names: the last epoch's),
    # nothing per epoch unless --save-every asks
    names = ["best.pth", "last.pth", f".model-{epochs - 1}.pth"]
    assert sorted(p.name for p in (out / "weights").iterdir()) == sorted(names)
    for name in ["best.pth", "last.pth"]:
        plain = create_model(num_classes, model)  # SMALL_MODEL, or DDP_MODEL
        plain.load_state_dict(torch.load(out / "weights" / name, weights_only=True))
    return lines


def test_a_short_single_process_run_learns(trained_run):
    out, result = trained_run
    metrics = assert_run_outputs(out, epochs=6, world_size=1)
    assert metrics[-1]["val_acc"] >= 0.5, metrics  # chance is 0.2
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert "No CUDA GPU found" in result.stdout or torch.cuda.is_available()


def test_tensorboard_shows_predictions_each_epoch_and_the_runs_flags(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(trained_run[0] / "tb"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    previews = events.Images("validation_predictions")
    assert [image.step for image in previews] == list(range(6))
    assert all(image.width >= 400 and len(image.encoded_image_string) > 10_000 for image in previews)
    best = [scalar.value for scalar in events.Scalars("hparams/best_val_acc")]
    expected = [max(m["val_acc"] for m in assert_run_outputs(trained_run[0], 6, 1)[: e + 1]) for e in range(6)]
    assert best == pytest.approx(expected)  # TensorBoard stores float32
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    flags = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert flags["epochs"].number_value == 6 and flags["img_size"].number_value == 32
    # switches as text (a bool would become the number 1); the precision and layout the run trained in
    assert flags["amp"].string_value == PINNED_COMPUTE[1] and flags["channels_last"].string_value == "False"


def test_data_parallel_without_several_gpus_trains_a_plain_model(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = run_here(
        "train_single_gpu.py", "--data-path", tiny_data, "--output-dir", out, "--epochs", "1", "--data-parallel", *FAST
    )
    assert result.returncode == 0, result.stderr
    assert "--data-parallel: only one device" in result.stdout or torch.cuda.device_count() > 1
    assert not any(name.startswith("module.") for name in final_weights(out))  # loads into a plain model


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc (Linux)")
def test_the_background_writer_starts_no_compute_threads_of_its_own(tiny_data, tmp_path, monkeypatch):
    """A torch operation in the thread that writes an epoch's files starts a team of OpenMP threads for that
    thread, kept while it lives; with more such threads than cores, the training's own team stops spinning at its
    barriers, and every later step on a 2-core CPU took 1.4x as long (docs/performance.md). The writer runs numpy
    and file writes only. Two compute threads here, as a 2-core machine runs, whatever this worker's share."""
    from multi_train_utils.epoch_writer import EpochWriter

    def started_by(work) -> set[str]:  # the threads that appeared while `work` ran, and are still there after it
        before = set(os.listdir("/proc/self/task"))
        work()
        return set(os.listdir("/proc/self/task")) - before

    def in_a_thread(work) -> set[str]:
        started = []
        thread = threading.Thread(target=lambda: started.append(started_by(work)))
        thread.start()
        thread.join()
        return started[0]

    threads, set_num_threads, written = torch.get_num_threads(), torch.set_num_threads, []
    monkeypatch.setattr(torch, "set_num_threads", lambda _: set_num_threads(2))
    try:
        torch.set_num_threads(2)
        assert in_a_thread(lambda: torch.ones(1 << 20).div_(255)), "a torch operation in a thread starts none here"
        original = EpochWriter.write
        monkeypatch.setattr(EpochWriter, "write", lambda w, job, after=None: original(
            w, lambda: written.append(started_by(job)), after))  # fmt: skip
        out = tmp_path / "run"
        # A preview of 10 images large enough that any torch operation on it is parallel (69,120 values, more than
        # torch's grain of 32,768); one step of 48 of the 50 images: the run's two threads oversubscribe a worker's
        # core in the suite, and every parallel region then spins while the other thread waits for a core
        size = ("--img-size", "48", "--batch-size", "48")
        result = run_here(
            "train_single_gpu.py", "--data-path", tiny_data, "--output-dir", out, "--epochs", "1", *FAST, *size
        )
    finally:
        set_num_threads(threads)
    assert result.returncode == 0, result.stderr
    assert written == [set()]  # epoch 0's files, written in the background by a thread that started none


# float32: the validation check below evaluates the saved weights in this process, in float32, and must find the
# very accuracy the run logged (under bf16 a near-tie may round either way). test_multinode covers DDP in bf16.
def test_torchrun_with_two_processes_completes_two_epochs(torchrun_run):
    result, out = torchrun_run
    assert_run_outputs(out, epochs=2, world_size=2, model=DDP_MODEL)
    assert "2 process(es) on cpu, backend gloo" in result.stdout
    assert result.stdout.count("Learning rate") == 1  # rank 0 alone prints
    # DDP: the images in the store (one rank built it, the other waited: either may be rank 0, which says which), each
    # batch streamed from it (DDP_FLAGS); the model not compiled, and why
    assert result.stdout.count("Images: 60 ") == 1
    assert result.stdout.count("Batches: made on the device (--batches device), streamed from the store") == 1
    assert result.stdout.count("Compile: off (auto never compiles: measured,") == 1


def test_spawn_with_two_processes_completes_two_epochs(spawn_run):
    result, out = spawn_run
    assert_run_outputs(out, epochs=2, world_size=2, model=DDP_MODEL)
    assert result.stdout.count("Learning rate") == 1


@pytest.mark.guarantee
@pytest.mark.across_launchers
def test_torchrun_and_spawn_train_identically(torchrun_run, spawn_run):
    a, b = final_weights(torchrun_run[1]), final_weights(spawn_run[1])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics_without_timings(torchrun_run[1]) == metrics_without_timings(spawn_run[1])


@pytest.mark.guarantee
@pytest.mark.across_launchers
def test_without_sync_bn_each_process_keeps_its_own_batchnorm_statistics(tiny_data, torchrun_run, tmp_path):
    # The same torchrun run as torchrun_run but for --no-sync-bn: rank 0's saved running statistics are then those
    # of its own shards, not of the global batches, so they differ; nothing else in the flags changes.
    result = run_script(
        "train_multi_gpu_using_launch.py", "--data-path", tiny_data, "--output-dir", tmp_path / "run", *DDP_FLAGS,
        "--no-sync-bn", launcher=torchrun(2),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    synced, own = final_weights(torchrun_run[1]), final_weights(tmp_path / "run")
    statistics = [key for key in synced if key.endswith("running_mean")]
    assert statistics and all(not torch.equal(synced[key], own[key]) for key in statistics)
    assert synced.keys() == own.keys()  # the same network: SyncBatchNorm adds no tensor of its own


@pytest.mark.guarantee
@pytest.mark.across_launchers
def test_logged_validation_accuracy_is_the_single_process_accuracy_of_the_saved_weights(tiny_data, torchrun_run):
    from wiring import loaders

    from dataset.folders import read_split_data
    from multi_train_utils.train_eval_utils import evaluate

    split = read_split_data(tiny_data, seed=3)
    model = create_model(5, DDP_MODEL)
    model.load_state_dict(final_weights(torchrun_run[1]))
    val_loader = loaders(split, img_size=32, batch_size=4, seed=3)[1]
    confusion = evaluate(model, val_loader, torch.device("cpu"), 5)
    logged = json.loads((torchrun_run[1] / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["val_total"] == len(split.val_images) == int(confusion.sum())
    assert logged["val_correct"] == int(confusion.trace())
    assert logged["val_per_class_correct"] == confusion.diagonal().tolist()


@pytest.mark.guarantee
def test_the_same_seed_gives_bitwise_identical_weights_and_another_seed_does_not(tiny_data, tmp_path, reference_run):
    def train(name, *flags):
        result = run_here("train_single_gpu.py", "--data-path", tiny_data, "--output-dir", tmp_path / name, *flags)
        assert result.returncode == 0, result.stderr
        return tmp_path / name

    # Again, the batches made by the loader this time (each image cropped and flipped in the loader, from a seed of
    # its own), where the reference run made them on the device: on the CPU both are the same bytes, so anything
    # either path drew from elsewhere than the seed (the clock, a generator left as it was) would show here.
    again = train("again", *REFERENCE_FLAGS, "--batches", "loader")  # the reference run's flags, seed 0 included
    expected, weights = final_weights(reference_run), final_weights(again)
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert metrics_without_timings(again) == metrics_without_timings(reference_run)
    other = train("other", *REFERENCE_FLAGS, "--seed", "1", "--epochs", "1")  # its first epoch is another already
    first_epoch = metrics_without_timings(reference_run)[0]
    assert metrics_without_timings(other)[0]["train_loss"] != first_epoch["train_loss"]


def test_launch_script_started_without_a_launcher_trains_in_one_process(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = run_script(
        "train_multi_gpu_using_launch.py", "--data-path", tiny_data, "--output-dir", out, "--epochs", "1", *FAST
    )
    assert result.returncode == 0, result.stderr
    assert "training in one process" in result.stdout
    assert_run_outputs(out, epochs=1, world_size=1)


def test_a_folder_of_grayscale_pngs_with_ten_classes_trains_unchanged(tmp_path):
    for c in range(10):
        (tmp_path / "data" / f"digit_{c}").mkdir(parents=True)
        for i in range(5):
            Image.new("L", (36, 36), color=20 * c + i).save(tmp_path / "data" / f"digit_{c}" / f"{i}.png")
    out = tmp_path / "run"
    result = run_here(
        "train_single_gpu.py", "--data-path", tmp_path / "data", "--output-dir", out, "--epochs", "1", *FAST
    )
    assert result.returncode == 0, result.stderr
    assert_run_outputs(out, epochs=1, world_size=1, num_classes=10)


@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_multi_gpu_using_spawn.py"])
def test_num_classes_disagreeing_with_the_folders_is_one_line_and_exit_2(tiny_data, tmp_path, run_main, script):
    result = run_main(script, "--data-path", tiny_data, "--num-classes", "7", "--output-dir", tmp_path / "o", *FAST)
    assert_user_error(result, "--num-classes 7 but")
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_multi_gpu_using_spawn.py"])
def test_asking_for_cuda_without_a_gpu_is_one_line_and_exit_2(tiny_data, tmp_path, run_main, script):
    result = run_main(script, "--data-path", tiny_data, "--device", "cuda", "--output-dir", tmp_path / "o", *FAST)
    assert_user_error(result, "no CUDA GPU is visible")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--epochs", "0"], "--epochs: must be at least 1"),
        (["--batch-size", "-4"], "--batch-size: must be at least 1"),
        (["--lr", "0"], "--lr: must be greater than 0"),
        (["--lr", "fast"], "--lr: invalid"),
    ],
)
def test_out_of_range_numbers_are_one_line_and_exit_2(tiny_data, run_main, flags, fragment):
    assert_user_error(run_main("train_single_gpu.py", "--data-path", tiny_data, *flags), fragment)


def test_no_data_path_is_one_line_and_exit_2(tmp_path, monkeypatch, run_main):
    monkeypatch.chdir(tmp_path)  # a folder without the default data folder, as a user's shell might be in
    assert_user_error(run_main("train_single_gpu.py"), "--data-path")


def test_an_output_dir_holding_a_run_is_never_overwritten(tiny_data, tmp_path, run_main):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--output-dir", out, *FAST)
    assert_user_error(result, "already holds a run")
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_boolean_flags_are_real_booleans(tiny_data, run_main):
    # The original's type=bool turned "--freeze-layers False" into True; here it is refused...
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--freeze-layers", "False", *FAST)
    assert_user_error(result, "unrecognized arguments: False")
    # ...and --no-freeze-layers / --freeze-layers say what they mean.
    from run.config import parse_config

    assert parse_config("train_single_gpu", "", ["--no-freeze-layers"]).freeze_layers is False
    assert parse_config("train_single_gpu", "", ["--freeze-layers"]).freeze_layers is True
    assert parse_config("train_multi_gpu_using_launch", "", ["--no-sync-bn"]).sync_bn is False
    assert parse_config("train_multi_gpu_using_launch", "", []).sync_bn is True


@pytest.mark.fast
def test_demo_settings_yield_to_flags_given_on_the_command_line():
    from run.config import DEMO_DEFAULTS, parse_config

    demo = parse_config("train_single_gpu", "", ["--demo"])
    assert {name: getattr(demo, name) for name in DEMO_DEFAULTS} == DEMO_DEFAULTS
    assert parse_config("train_single_gpu", "", ["--demo", "--epochs", "3"]).epochs == 3
    assert parse_config("train_single_gpu", "", []).epochs == 30
