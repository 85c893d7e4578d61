"""A data folder of train/ and val/ alone (ImageNet's layout) is used as given: read_split_data's rule for telling
it from a class-per-folder dataset, its refusals, and a training run and evaluate.py that take val/ as it is."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import FAST, assert_user_error, run_here
from PIL import Image

import evaluate
from dataset.demo import make_demo_data
from dataset.folders import list_images, read_split_data
from utils import UserError


def write_jpeg(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 40, 40)).save(path)


def make_given(root: Path, train: dict, val: dict) -> Path:
    """train/ and val/ holding `counts[class]` tiny JPEGs in each class folder."""
    for part, counts in (("train", train), ("val", val)):
        for name, count in counts.items():
            (root / part / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                write_jpeg(root / part / name / f"{part}{i:03d}.jpg")
    return root


def files_by_class(folder: Path) -> dict[str, set[str]]:
    return {cls.name: {str(p) for p in list_images(cls)} for cls in sorted(folder.iterdir())}


@pytest.mark.parametrize("val_rate, seed", [(0.2, 0), (0.5, 7), (0.9, 123)])
@pytest.mark.fast
def test_each_set_is_exactly_its_folder_whatever_the_rate_and_seed(tmp_path, val_rate, seed):
    root = make_given(tmp_path, {"roses": 7, "daisy": 5}, {"roses": 1, "daisy": 4})
    (root / "README.md").touch()  # loose files beside train/ and val/ are ignored, as beside class folders
    (root / ".cache").mkdir()  # and so are hidden folders
    split = read_split_data(root, val_rate=val_rate, seed=seed)
    assert split.given and split.classes == ["daisy", "roses"]
    for images, labels, part in (
        (split.train_images, split.train_labels, "train"),
        (split.val_images, split.val_labels, "val"),
    ):
        found = {name: set() for name in split.classes}
        for path, label in zip(images, labels, strict=True):
            found[split.classes[label]].add(path)
        assert found == files_by_class(root / part)
        assert len(images) == len(set(images))  # each file once
    assert (len(split.train_images), len(split.val_images)) == (12, 5)


@pytest.mark.fast
def test_a_class_folder_named_train_among_others_is_still_a_class(tmp_path):
    root = tmp_path / "vehicles"
    for name in ("bus", "car", "train"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            (root / name / f"{i}.jpg").touch()
    split = read_split_data(root)
    assert not split.given and split.classes == ["bus", "car", "train"]
    assert len(split.val_images) == 3  # one of each 5 at the default rate: split at random, as any such folder


@pytest.mark.fast
def test_unreadable_images_are_left_out_of_the_set_they_are_in(tmp_path):
    for part, name in (("train", "a0"), ("train", "a1"), ("val", "a0"), ("val", "a1")):
        write_jpeg(tmp_path / part / "daisy" / f"{name}.jpg")
    (tmp_path / "val" / "daisy" / "broken.jpg").write_bytes(b"not a jpeg")
    split = read_split_data(tmp_path, verify_images=True)
    assert split.unreadable == [str(tmp_path / "val" / "daisy" / "broken.jpg")]
    assert sorted(Path(p).name for p in split.val_images) == ["a0.jpg", "a1.jpg"]
    assert len(split.train_images) == 2


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            "classes_differ",
            "train/ and val/ of {root} have different classes: only in train/: tulips; only in val/: iris",
        ),
        ("only_in_val", "only in val/: iris"),
        ("empty_val_class", "class folder {root}/val/roses holds no readable images"),
        ("unreadable_only", "class folder {root}/train/roses holds no readable images"),
        ("test_beside", "holds train/ and val/ beside other folders (test)"),
        ("images_in_train", "{root}/train has no class sub-folders"),  # class-per-folder with classes train, val
    ],
)
@pytest.mark.fast
def test_unusable_train_val_folders_are_one_line_errors(tmp_path, layout, message):
    root = tmp_path / "data"
    both = {"daisy": 2, "roses": 2}
    if layout == "classes_differ":
        make_given(root, {**both, "tulips": 2}, {**both, "iris": 1})
    elif layout == "only_in_val":
        make_given(root, both, {**both, "iris": 1})
    elif layout == "empty_val_class":
        make_given(root, both, {"daisy": 2, "roses": 0})
    elif layout == "unreadable_only":
        make_given(root, {"daisy": 2, "roses": 0}, both)
        (root / "train" / "roses" / "broken.jpg").write_bytes(b"not a jpeg")
    elif layout == "test_beside":
        make_given(root, both, both)
        make_given(root / "test", both, {})  # root/test/train/...: any third folder
    elif layout == "images_in_train":
        for part in ("train", "val"):
            (root / part).mkdir(parents=True)
            (root / part / "1.jpg").touch()
    with pytest.raises(UserError) as error:
        read_split_data(root, verify_images=True)
    assert message.format(root=root) in str(error.value) and "\n" not in str(error.value)


def test_training_refuses_disagreeing_classes_in_one_line_and_writes_nothing(tmp_path, run_main):
    root = make_given(tmp_path / "data", {"daisy": 8, "roses": 8}, {"daisy": 2, "tulips": 2})
    out = tmp_path / "run"
    result = run_main("train_single_gpu.py", "--data-path", root, "--output-dir", out, "--epochs", "1", *FAST)
    expected = f"train/ and val/ of {root} have different classes: only in train/: roses; only in val/: tulips"
    assert_user_error(result, expected)
    assert not out.exists()


@pytest.fixture(scope="module")
def given_data(tmp_path_factory) -> Path:
    """The tiny demo flowers (5 classes x 12) as train/ and val/: the first 2 or 3 of each class validate."""
    flat = make_demo_data(tmp_path_factory.mktemp("flat") / "tiny", images_per_class=12, size=(48, 40))
    root = tmp_path_factory.mktemp("given") / "flowers"
    for index, cls in enumerate(sorted(flat.iterdir())):
        images = list_images(cls)
        num_val = 2 + index % 2  # unequal, so that no rate reproduces it: 2, 3, 2, 3, 2
        for part, chosen in (("val", images[:num_val]), ("train", images[num_val:])):
            (root / part / cls.name).mkdir(parents=True)
            for image in chosen:
                shutil.copy(image, root / part / cls.name / image.name)
    return root


@pytest.fixture(scope="module")
def given_run(given_data, tmp_path_factory):
    """One epoch at 32 px on given_data, with a --val-rate that would split differently: (run folder, process)."""
    out = tmp_path_factory.mktemp("given_run") / "run"
    result = run_here(
        "train_single_gpu.py", "--data-path", given_data, "--output-dir", out, "--epochs", "1", "--val-rate", "0.5",
        *FAST,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out, result


def test_training_validates_on_val_as_given(given_data, given_run):
    out, result = given_run
    val_counts = [len(list_images(cls)) for cls in sorted((given_data / "val").iterdir())]
    train_count = sum(len(list_images(cls)) for cls in (given_data / "train").iterdir())
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["val_total"] == sum(val_counts) == 12
    assert metrics["val_per_class_total"] == val_counts == [2, 3, 2, 3, 2]
    assert metrics["train_images"] == train_count // 8 * 8  # FAST's batch of 8, incomplete batches dropped
    assert f"note: --val-rate 0.5 is ignored: {given_data} holds train/ and val/, used as given" in result.stdout
    assert f"Data: {train_count} training / 12 validation images, 5 classes (train/, val/ as given)" in result.stdout


def test_evaluate_takes_the_runs_val_folder(given_data, given_run, tmp_path, capsys):
    out, _ = given_run
    evaluate.main.__wrapped__(["--weights", str(out / "weights" / "best.pth"), "--output-dir", str(tmp_path)])
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["split"] == {"images": "validation", "data_path": str(given_data), "given": True}
    assert report["total"] == 12 and [row["support"] for row in report["per_class"].values()] == [2, 3, 2, 3, 2]
    metrics = json.loads((out / "metrics.jsonl").read_text())
    assert report["correct"] == metrics["val_correct"]  # the same weights on the same images
    printed = capsys.readouterr().out
    assert f"on the 12 validation images of {given_data} (its val/ folder, as given)" in printed
    assert "val-rate" not in printed
