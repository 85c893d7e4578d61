"""Bad input: one clear line on stderr, exit status 2, nothing overwritten; unreadable images skipped or refused."""

import shutil

import pytest
import torch
from conftest import FAST, PINNED, assert_user_error, run_here
from torchvision.models import mobilenet_v3_small

from dataset.folders import write_class_indices
from multi_train_utils.checkpoint import save_epoch, training_state
from multi_train_utils.train_eval_utils import Training
from network.architectures import create_model
from recipe.optimizer import build_optimizer
from run.config import SINGLE, parse_config
from utils import write_json


@pytest.fixture
def data_with_bad_images(tiny_data, tmp_path):
    root = shutil.copytree(tiny_data, tmp_path / "data")
    jpeg = next((root / "roses").glob("*.jpg")).read_bytes()
    (root / "roses" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (root / "tulips" / "notes.JPG").write_text("not an image at all")
    return root


def test_unreadable_images_are_skipped_with_one_warning_naming_them(data_with_bad_images, tmp_path):
    result = run_here("train_single_gpu.py", "--data-path", data_with_bad_images, "--epochs", "1",
                      "--output-dir", tmp_path / "run", *FAST)  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "truncated.jpg" in warnings[0] and "notes.JPG" in warnings[0]
    assert "skipped 2 unreadable image(s)" in warnings[0]


def test_strict_images_turns_unreadable_images_into_an_error(data_with_bad_images, tmp_path, run_main):
    result = run_main("train_single_gpu.py", "--data-path", data_with_bad_images, "--strict-images",
                        "--output-dir", tmp_path / "run", *FAST)  # fmt: skip
    assert_user_error(result, "2 unreadable image(s) (--strict-images)")
    assert not (tmp_path / "run").exists()


def bad_weights(tmp_path, kind, tiny_data=None):
    path = tmp_path / f"{kind}.pth"
    if kind == "text":
        path.write_text("not weights")
    elif kind == "jpeg":
        shutil.copy(next((tiny_data / "roses").glob("*.jpg")), path)
    elif kind == "mobilenet_v3_small":
        torch.save(mobilenet_v3_small(num_classes=5).state_dict(), path)
    return path  # "missing": never created


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("missing", "does not exist"),
        ("text", "is not a PyTorch file (a text file, beginning 'not weights')"),
        ("jpeg", "is not a PyTorch file (a JPEG image)"),
        ("mobilenet_v3_small", "has no tensor that fits this model"),
    ],
)
def test_unusable_weights_are_one_line_and_exit_2(tiny_data, tmp_path, run_main, kind, fragment):
    weights = bad_weights(tmp_path, kind, tiny_data)
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--weights", weights,
                        "--output-dir", tmp_path / "run", *FAST)  # fmt: skip
    assert_user_error(result, fragment)
    assert "safe loader" not in result.stderr  # the words of a pickle that would run code, refused


def test_unusable_resume_files_are_one_line_and_exit_2(tiny_data, tmp_path, run_main):
    weights_only = tmp_path / "weights.pth"
    torch.save(create_model(5).state_dict(), weights_only)
    truncated = tmp_path / "checkpoint.pth"
    truncated.write_bytes(weights_only.read_bytes()[:1000])
    for path, fragment in [
        (tmp_path / "absent.pth", "does not exist"),
        (truncated, "cannot be read"),
        (weights_only, "not a training checkpoint"),
        (bad_weights(tmp_path, "jpeg", tiny_data), "is not a PyTorch file (a JPEG image)"),
    ]:
        assert_user_error(run_main("train_single_gpu.py", "--data-path", tiny_data, "--resume", path, *FAST), fragment)


RUN_FLAGS = ("--img-size", "32", "--batch-size", "8", "--epochs", "2", *PINNED)


@pytest.fixture(scope="module")
def resnet18_run(tiny_data, tmp_path_factory):
    """A run folder as a ResNet-18 run on tiny_data leaves it after its first epoch (RUN_FLAGS): args.json,
    class_indices.json, weights/best.pth and last.pth, checkpoint.pth. Written as the scripts write them, without
    training."""
    run = tmp_path_factory.mktemp("resnet18_run")
    config = parse_config(SINGLE, "", ["--data-path", str(tiny_data), "--model", "resnet18", *RUN_FLAGS])
    record = config.record(world_size=1, recipe_world_size=1, split=None)
    classes = sorted(folder.name for folder in tiny_data.iterdir())
    model = create_model(len(classes), "resnet18")
    training = Training(model, *build_optimizer(model, config, 1))
    write_json(run / "args.json", record)
    write_class_indices(classes, run)
    state = training_state(0, model, training, 0.5, classes, 1, record)
    save_epoch(run, 0, state, best="model")
    return run


@pytest.mark.fast
def test_a_resume_as_another_model_names_both_and_suggests_no_weights_that_fit_no_other(
    tiny_data, resnet18_run, run_main
):
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--resume", resnet18_run / "checkpoint.pth",
                      "--model", "resnet34", *RUN_FLAGS)  # fmt: skip
    assert_user_error(result, "checkpoint.pth is a checkpoint of resnet18, not of resnet34 (--model): resume it with")
    assert f"--config {resnet18_run / 'args.json'}" in result.stderr and "--weights" not in result.stderr


@pytest.mark.fast
@pytest.mark.parametrize("weights", ["checkpoint.pth", "weights/best.pth"])
def test_weights_of_another_model_name_the_model_they_are_of(tiny_data, resnet18_run, tmp_path, run_main, weights):
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--weights", resnet18_run / weights,
                      "--model", "resnet34", "--output-dir", tmp_path / "run", *RUN_FLAGS)  # fmt: skip
    assert_user_error(
        result,
        f"weights file {resnet18_run / weights} holds resnet18's weights (run flags file "
        f"{resnet18_run / 'args.json'} says --model resnet18), which do not fit resnet34 (--model): train resnet18",
    )


@pytest.mark.fast
def test_weights_that_cannot_be_read_are_said_so_whatever_model_their_run_was(tiny_data, resnet18_run, run_main):
    for weights, fragment in [("weights/typo.pth", "does not exist"), ("args.json", "is not a PyTorch file")]:
        result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--weights", resnet18_run / weights,
                          "--model", "resnet34", *RUN_FLAGS)  # fmt: skip
        assert_user_error(result, f"weights file {resnet18_run / weights} {fragment}")


@pytest.mark.fast
def test_predicting_as_another_model_names_the_weights_and_their_model(tiny_data, resnet18_run, tmp_path, run_main):
    image = next((tiny_data / "daisy").glob("*.jpg"))
    best = resnet18_run / "weights" / "best.pth"
    result = run_main("predict.py", image, "--model", "resnet34", "--weights", best)
    assert_user_error(
        result,
        f"weights file {best} holds resnet18's weights (run flags file {resnet18_run / 'args.json'} says --model "
        "resnet18), which do not fit resnet34 (--model): leave out --model (the run's resnet18 is used)",
    )
    alone = tmp_path / "best.pth"  # with no run's args.json beside them: their model is not known
    shutil.copy(best, alone)
    shutil.copy(resnet18_run / "class_indices.json", tmp_path)
    result = run_main("predict.py", image, "--model", "resnet34", "--weights", alone)
    assert_user_error(result, f"weights file {alone} does not fit resnet34: ")
    assert "resnet34 is --model" in result.stderr


def test_an_output_folder_that_cannot_be_written_is_one_line_and_exit_2(tiny_data, tmp_path, run_main):
    (tmp_path / "a_file").write_text("")
    result = run_main("train_single_gpu.py", "--data-path", tiny_data, "--output-dir", tmp_path / "a_file" / "run")
    assert_user_error(result, "cannot write the output folder")


def test_a_batch_larger_than_a_process_share_of_the_data_is_one_line_and_exit_2(tiny_data, tmp_path, run_main):
    result = run_main("train_multi_gpu_using_spawn.py", "--data-path", tiny_data, "--world-size", "2",
                        "--batch-size", "40", "--output-dir", tmp_path / "run")  # fmt: skip
    assert_user_error(result, "an epoch would have no step")


@pytest.mark.fast
def test_a_data_path_one_level_too_high_is_named_as_such(tmp_path, run_main):
    (tmp_path / "data" / "flower_photos" / "daisy").mkdir(parents=True)  # the classes one level down
    (tmp_path / "data" / "flower_photos" / "daisy" / "1.jpg").touch()
    result = run_main("train_single_gpu.py", "--data-path", tmp_path / "data", "--output-dir", tmp_path / "run")
    assert_user_error(result, "only sub-folders (daisy), whose images are not read")
    assert "one level too high" in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.fast
def test_data_of_one_class_is_refused_before_training(tiny_data, tmp_path, run_main):
    shutil.copytree(tiny_data / "daisy", tmp_path / "data" / "daisy")
    result = run_main("train_single_gpu.py", "--data-path", tmp_path / "data", "--output-dir", tmp_path / "run",
                      "--epochs", "1", *FAST)  # fmt: skip
    assert_user_error(result, "has one class folder (daisy): a classifier needs at least 2 classes")
    assert not (tmp_path / "run").exists()


def test_auto_resume_needs_an_output_folder(tiny_data, run_main):
    assert_user_error(run_main("train_single_gpu.py", "--data-path", tiny_data, "--auto-resume"), "--output-dir")


def test_spawn_chooses_another_port_when_master_port_is_taken(spawn_run):
    result, out = spawn_run  # started with MASTER_PORT set to a port the test session held (taken_port)
    taken_port = (out.parent / "master_port.txt").read_text()
    assert f"MASTER_PORT {taken_port} is taken; using" in result.stdout
    assert (out / "checkpoint.pth").exists()


@pytest.mark.fast
def test_spawn_refuses_more_processes_than_visible_gpus(tiny_data, monkeypatch, capsys):
    # Pretend one GPU is visible: the check runs before any process or CUDA call is made.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    import train_multi_gpu_using_spawn

    with pytest.raises(SystemExit) as exit_info:
        train_multi_gpu_using_spawn.main(["--data-path", str(tiny_data), "--device", "cuda", "--world-size", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --world-size 2 but only 1 GPUs are visible (one process per GPU)"


@pytest.mark.fast
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record's, here where capsys holds stderr
def test_under_torchrun_a_user_error_is_still_one_line_and_writes_no_error_file(tmp_path, run_main, monkeypatch):
    # The launch script's main is also torchrun's @record: bad input stays one line and exit status 2, and leaves
    # torchrun's error file (for crashes, with their traceback) unwritten.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    result = run_main("train_multi_gpu_using_launch.py", "--data-path", tmp_path / "missing")
    assert_user_error(result, f"data path {tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "error.json").exists()


@pytest.mark.parametrize("model", ["vit_b_16", "timm/vit_tiny_patch16_224"])
def test_a_model_that_cannot_take_the_image_size_is_refused_in_one_line_before_any_folder_is_made(
    model, tiny_data, tmp_path, run_main
):
    # torchvision's and timm's ViTs take their own size alone (224 px): at the demo's 48 px their forward pass fails
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, "--output-dir", out, "--model", model, "--img-size", "48", "--epochs", "1")
    result = run_main("train_single_gpu.py", *flags)
    assert_user_error(result, f"--model {model} does not take --img-size 48 images")
    assert "224" in result.stderr and not out.exists()  # the size it takes named; the corrected command free to run
