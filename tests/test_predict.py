"""predict.py: each image's likeliest classes by name, from the weights of a trained run, as a user runs it."""

import contextlib
import io
import json
import shutil

import pytest
import torch
from conftest import assert_user_error, run_script
from torch.utils.data import DataLoader
from torchvision.models import get_model

import predict
from dataset.folders import read_split_data
from dataset.transforms import val_transform
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.train_eval_utils import Choice
from my_dataset import MyDataSet
from network.architectures import create_model
from utils import UserError


def parse_predictions(stdout: str) -> dict[str, list[tuple[str, float]]]:
    """{image path: [(class name, probability), ...]} from lines like `x/1.jpg: daisy 0.912, tulips 0.051`."""
    predictions = {}
    for line in stdout.splitlines():
        path, ranked = line.rsplit(": ", 1)
        predictions[path] = [(name, float(p)) for name, p in (item.rsplit(" ", 1) for item in ranked.split(", "))]
    return predictions


def probabilities_in_process(weights, images, run_args: dict) -> torch.Tensor:
    """What the network gives for `images`, computed here with torchvision, in batches of 16 and in the precision
    and memory layout the run validated in (its --amp and --channels-last)."""
    model = get_model(run_args["model"], num_classes=5)
    model.load_state_dict(torch.load(weights, weights_only=True))
    choice = Choice(run_args["amp"], run_args["channels_last"])
    model = model.to(memory_format=choice.memory_format).eval()
    loader = DataLoader(MyDataSet(images, [0] * len(images), val_transform(run_args["img_size"])), batch_size=16)
    with torch.no_grad(), choice.autocast(torch.device("cpu")):
        return torch.cat([model(choice.batch_to(batch, "cpu")).float().softmax(dim=1) for batch, _ in loader])


def user_error(*argv) -> str:
    """The UserError predict.py stops with for these arguments, run in this process (no interpreter start-up)."""
    with pytest.raises(UserError) as caught:
        predict.main.__wrapped__([str(arg) for arg in argv])
    return str(caught.value)


@pytest.fixture(scope="module")
def run_args(trained_run) -> dict:
    return json.loads((trained_run[0] / "args.json").read_text())


@pytest.fixture(scope="module")
def validation_images(run_args) -> tuple[list[str], list[str]]:
    """The images the run validated on, as its flags split the data, and the name of each one's true class."""
    split = read_split_data(run_args["data_path"], run_args["val_rate"], run_args["seed"])
    return split.val_images, [split.classes[label] for label in split.val_labels]


@pytest.fixture(scope="module")
def best_predictions(trained_run, validation_images):
    """predict.py over the validation images with the best weights, flags left at their defaults."""
    result = run_script("predict.py", *validation_images[0], "--weights", trained_run[0] / "weights" / "best.pth")
    assert result.returncode == 0, result.stderr
    return parse_predictions(result.stdout)


def test_each_image_gets_one_line_with_its_three_likeliest_classes(trained_run, best_predictions, validation_images):
    classes = list(json.loads((trained_run[0] / "class_indices.json").read_text()).values())
    assert list(best_predictions) == validation_images[0]
    for ranked in best_predictions.values():
        names, probabilities = zip(*ranked, strict=True)
        assert len(set(names)) == 3 and set(names) <= set(classes)
        assert list(probabilities) == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0015


def test_the_best_weights_name_the_true_class_as_often_as_in_their_epoch(
    trained_run, best_predictions, validation_images
):
    correct = sum(
        ranked[0][0] == true_class
        for ranked, true_class in zip(best_predictions.values(), validation_images[1], strict=True)
    )
    metrics = [json.loads(line) for line in (trained_run[0] / "metrics.jsonl").read_text().splitlines()]
    assert correct / len(validation_images[0]) >= 0.5  # chance is 0.2
    assert correct == max(m["val_correct"] for m in metrics)  # best.pth is the first epoch with the most correct


def test_the_probabilities_are_the_networks_softmax(trained_run, run_args, best_predictions, validation_images):
    classes = list(json.loads((trained_run[0] / "class_indices.json").read_text()).values())
    first_batch = validation_images[0][:16]  # enough to check, and the same batch predict.py computed
    expected = probabilities_in_process(trained_run[0] / "weights" / "best.pth", first_batch, run_args)
    for ranked, probabilities in zip([best_predictions[image] for image in first_batch], expected, strict=True):
        assert ranked[0][0] == classes[probabilities.argmax()]
        for name, probability in ranked:
            assert probability == pytest.approx(probabilities[classes.index(name)].item(), abs=6e-4)  # 3 decimals


@pytest.fixture(scope="module")
def folder_run(trained_run, tmp_path_factory, validation_images):
    """predict.py on a folder with a sub-folder, other files and a hidden folder, with --topk 9, and weights that
    are a checkpoint.pth on its own: no class_indices.json or args.json beside it or above it. In this process (the
    command line as a user runs it is best_predictions'; another interpreter would only add its start-up)."""
    tmp = tmp_path_factory.mktemp("predict_folder")
    photos = tmp / "photos"
    for index, relative in enumerate(["a.jpg", "b.PNG", "more/c.jpeg", ".hidden/d.jpg"]):
        (photos / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(validation_images[0][index], photos / relative)  # a JPEG named .PNG: PIL goes by the content
    (photos / "notes.txt").write_text("not an image")
    (tmp / "alone").mkdir()
    (tmp / "alone" / "checkpoint.pth").symlink_to(trained_run[0] / "checkpoint.pth")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        predict.main([str(photos), "--weights", str(tmp / "alone" / "checkpoint.pth"), "--topk", "9"])
    return photos, parse_predictions(printed.getvalue())


def test_a_folder_is_searched_with_its_sub_folders_one_line_per_image(folder_run):
    photos, predictions = folder_run
    assert list(predictions) == [str(photos / "a.jpg"), str(photos / "b.PNG"), str(photos / "more" / "c.jpeg")]


def test_topk_is_capped_at_the_number_of_classes(folder_run):
    for ranked in folder_run[1].values():
        assert sorted(name for name, _ in ranked) == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]


def test_a_checkpoint_on_its_own_carries_its_class_names_and_image_size(trained_run, run_args, folder_run, tmp_path):
    predictions = folder_run[1]
    state = load_checkpoint(trained_run[0] / "checkpoint.pth")
    torch.save(state["model"], tmp_path / "last.pth")
    expected = probabilities_in_process(tmp_path / "last.pth", list(predictions), run_args)
    for ranked, probabilities in zip(predictions.values(), expected, strict=True):
        assert dict(ranked) == pytest.approx(dict(zip(state["classes"], probabilities.tolist(), strict=True)), abs=6e-4)


def test_a_path_that_does_not_exist_is_one_line_and_exit_2(trained_run, tmp_path, run_main):
    result = run_main("predict.py", tmp_path / "absent.jpg", "--weights", trained_run[0] / "weights" / "best.pth")
    assert_user_error(result, f"{tmp_path / 'absent.jpg'} does not exist")


def test_an_unreadable_image_is_reported_in_its_line_and_the_others_are_scored(
    trained_run, validation_images, tmp_path, capsys
):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 half a JPEG")
    images = [validation_images[0][0], str(broken), validation_images[0][1]]
    predict.main([*images, "--weights", str(trained_run[0] / "weights" / "best.pth")])  # in this process
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == images  # in order, each once
    assert lines[1].startswith(f"{broken}: unreadable (") and "Truncated" in lines[1]  # why, as PIL says it
    assert len(parse_predictions("\n".join(lines[::2]))[images[0]]) == 3
    assert "warning: 1 image(s) could not be read; their lines say why" in printed.err


def test_an_empty_folder_is_refused_by_name(trained_run, tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    message = user_error(tmp_path / "empty", "--weights", trained_run[0] / "weights" / "best.pth")
    assert f"folder {tmp_path / 'empty'} holds no images" in message


def test_weights_for_another_number_of_classes_are_refused_naming_both_counts(trained_run, validation_images, tmp_path):
    torch.save(create_model(3).state_dict(), tmp_path / "three.pth")
    message = user_error(
        validation_images[0][0],
        "--weights",
        tmp_path / "three.pth",
        "--class-indices",
        trained_run[0] / "class_indices.json",
    )
    assert "has a head for 3 classes" in message and "names 5" in message


def test_weights_without_class_names_ask_for_class_indices(trained_run, validation_images, tmp_path):
    (tmp_path / "best.pth").symlink_to(trained_run[0] / "weights" / "best.pth")  # a plain state dict, alone
    assert "pass --class-indices" in user_error(validation_images[0][0], "--weights", tmp_path / "best.pth")


def test_weights_whose_run_lost_its_args_json_take_the_flags_its_checkpoint_records_and_say_so(
    trained_run, best_predictions, validation_images, tmp_path, capsys
):
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    for name in ("weights/best.pth", "class_indices.json", "checkpoint.pth"):  # args.json gone
        shutil.copy(trained_run[0] / name, run / name)
    images = validation_images[0][:4]
    predict.main([*images, "--weights", str(run / "weights" / "best.pth")])
    printed = capsys.readouterr()
    assert parse_predictions(printed.out) == {image: best_predictions[image] for image in images}  # at its 32 px
    assert printed.err.splitlines() == [
        f"warning: no args.json beside {run / 'weights' / 'best.pth'} or in its run folder: the run's flags are "
        f"read from {run / 'checkpoint.pth'}"
    ]
    # Nothing records them: the defaults, named (here 224 px for a 32 px run; its --model given)
    (run / "checkpoint.pth").unlink()
    predict.main([*images, "--weights", str(run / "weights" / "best.pth"), "--model", "resnet18"])
    (warning,) = capsys.readouterr().err.splitlines()
    assert "no record of the flags of the run" in warning and "(--img-size 224, --model resnet34" in warning
