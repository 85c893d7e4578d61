"""The three scripts end to end, run as a user runs them: what they print, exit with and write."""

import json

import pytest
import torch
from conftest import FAST, run_script, torchrun
from PIL import Image
from torchvision.models import resnet34

METRIC_KEYS = {"epoch", "train_loss", "val_acc", "lr", "epoch_seconds", "train_images_per_sec", "world_size"}


def assert_run_outputs(out, epochs: int, world_size: int, num_classes: int = 5):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == list(range(epochs))
    for m in lines:
        assert METRIC_KEYS <= m.keys()
        assert m["world_size"] == world_size
        assert 0.0 <= m["val_acc"] <= 1.0 and m["train_loss"] > 0 and m["train_images_per_sec"] > 0
    assert len(json.loads((out / "class_indices.json").read_text())) == num_classes
    assert list((out / "tb").glob("events.out.tfevents.*"))
    for name in [f"model-{e}.pth" for e in range(epochs)] + ["best.pth"]:
        plain = resnet34(num_classes=num_classes)
        plain.load_state_dict(torch.load(out / "weights" / name, weights_only=True))
    return lines


def test_a_short_single_process_run_learns(learnable_data, tmp_path):
    out = tmp_path / "run"
    result = run_script(
        "train_single_gpu.py",
        *("--data-path", learnable_data, "--output-dir", out, "--img-size", "64", "--batch-size", "16"),
        *("--epochs", "6", "--lr", "0.01", "--workers", "1"),
    )
    assert result.returncode == 0, result.stderr
    metrics = assert_run_outputs(out, epochs=6, world_size=1)
    assert metrics[-1]["val_acc"] >= 0.5, metrics  # chance is 0.2
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert "No CUDA GPU found" in result.stdout or torch.cuda.is_available()


def test_torchrun_with_two_processes_completes_two_epochs(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = run_script(
        "train_multi_gpu_using_launch.py",
        *("--data-path", tiny_data, "--output-dir", out, "--epochs", "2", "--device", "cpu", *FAST),
        launcher=torchrun(2),
    )
    assert result.returncode == 0, result.stderr
    assert_run_outputs(out, epochs=2, world_size=2)
    assert "2 process(es) on cpu, backend gloo" in result.stdout
    assert result.stdout.count("Learning rate") == 1  # rank 0 alone prints


def test_spawn_with_two_processes_completes_two_epochs(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = run_script(
        "train_multi_gpu_using_spawn.py",
        *(
            "--data-path",
            tiny_data,
            "--output-dir",
            out,
            "--epochs",
            "2",
            "--device",
            "cpu",
            "--world-size",
            "2",
            *FAST,
        ),
    )
    assert result.returncode == 0, result.stderr
    assert_run_outputs(out, epochs=2, world_size=2)
    assert result.stdout.count("Learning rate") == 1


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
    result = run_script(
        "train_single_gpu.py", "--data-path", tmp_path / "data", "--output-dir", out, "--epochs", "1", *FAST
    )
    assert result.returncode == 0, result.stderr
    assert_run_outputs(out, epochs=1, world_size=1, num_classes=10)


def assert_user_error(result, fragment: str):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_multi_gpu_using_spawn.py"])
def test_num_classes_disagreeing_with_the_folders_is_one_line_and_exit_2(tiny_data, tmp_path, script):
    result = run_script(script, "--data-path", tiny_data, "--num-classes", "7", "--output-dir", tmp_path / "o", *FAST)
    assert_user_error(result, "--num-classes 7 but")
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_multi_gpu_using_spawn.py"])
def test_asking_for_cuda_without_a_gpu_is_one_line_and_exit_2(tiny_data, tmp_path, script):
    result = run_script(script, "--data-path", tiny_data, "--device", "cuda", "--output-dir", tmp_path / "o", *FAST)
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
def test_out_of_range_numbers_are_one_line_and_exit_2(tiny_data, flags, fragment):
    assert_user_error(run_script("train_single_gpu.py", "--data-path", tiny_data, *flags), fragment)


def test_no_data_path_is_one_line_and_exit_2(tmp_path):
    assert_user_error(run_script("train_single_gpu.py", cwd=tmp_path), "--data-path")


def test_an_output_dir_holding_a_run_is_never_overwritten(tiny_data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    result = run_script("train_single_gpu.py", "--data-path", tiny_data, "--output-dir", out, *FAST)
    assert_user_error(result, "already holds a run")
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_boolean_flags_are_real_booleans(tiny_data, tmp_path):
    # The original's type=bool turned "--freeze-layers False" into True; here it is refused...
    result = run_script("train_single_gpu.py", "--data-path", tiny_data, "--freeze-layers", "False", *FAST)
    assert_user_error(result, "unrecognized arguments: False")
    # ...and --no-freeze-layers / --freeze-layers say what they mean.
    from training import parse_args

    assert parse_args("train_single_gpu", "", ["--no-freeze-layers"]).freeze_layers is False
    assert parse_args("train_single_gpu", "", ["--freeze-layers"]).freeze_layers is True
    assert parse_args("train_multi_gpu_using_launch", "", ["--no-sync-bn"]).sync_bn is False
    assert parse_args("train_multi_gpu_using_launch", "", []).sync_bn is True


def test_demo_settings_yield_to_flags_given_on_the_command_line():
    from training import DEMO_DEFAULTS, parse_args

    demo = parse_args("train_single_gpu", "", ["--demo"])
    assert (demo.epochs, demo.img_size, demo.lr) == (
        DEMO_DEFAULTS["epochs"],
        DEMO_DEFAULTS["img_size"],
        DEMO_DEFAULTS["lr"],
    )
    assert parse_args("train_single_gpu", "", ["--demo", "--epochs", "3"]).epochs == 3
    assert parse_args("train_single_gpu", "", []).epochs == 30
