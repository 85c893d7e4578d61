"""read_split_data: which images train, which validate, and what class_indices.json says."""

import json
import os
import random

import pytest

from dataset.folders import read_split_data
from utils import UserError

pytestmark = pytest.mark.fast  # no script started, no training run


def make_folder(root, counts: dict, suffix=".jpg", order_seed=None):
    """Empty files standing in for images (splitting never opens them), created in a chosen order."""
    names = [(cls, f"img{i:03d}{suffix}") for cls, n in counts.items() for i in range(n)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(names)
    for cls, name in names:
        (root / cls).mkdir(parents=True, exist_ok=True)
        (root / cls / name).touch()
    return root


def relative(paths, root):
    return [os.path.relpath(p, root) for p in paths]


def test_split_is_identical_whatever_the_order_files_were_created_in(tmp_path):
    counts = {"roses": 23, "daisy": 17, "tulips": 31}
    a = read_split_data(make_folder(tmp_path / "a", counts, order_seed=1), seed=7)
    b = read_split_data(make_folder(tmp_path / "b", counts, order_seed=2), seed=7)
    assert relative(a.val_images, tmp_path / "a") == relative(b.val_images, tmp_path / "b")
    assert relative(a.train_images, tmp_path / "a") == relative(b.train_images, tmp_path / "b")


def test_split_depends_on_the_seed(tmp_path):
    root = make_folder(tmp_path, {"a": 40, "b": 40})
    assert read_split_data(root, seed=0).val_images != read_split_data(root, seed=1).val_images


def test_each_class_is_split_on_its_own_at_the_validation_rate(tmp_path):
    root = make_folder(tmp_path, {"daisy": 10, "roses": 50})
    split = read_split_data(root, val_rate=0.2)
    assert split.classes == ["daisy", "roses"]
    assert split.val_labels.count(0) == 2 and split.val_labels.count(1) == 10
    assert split.train_labels.count(0) == 8 and split.train_labels.count(1) == 40
    assert not set(split.train_images) & set(split.val_images)
    assert len(split.train_images) + len(split.val_images) == 60
    for path, label in zip(split.train_images + split.val_images, split.train_labels + split.val_labels, strict=True):
        assert os.path.basename(os.path.dirname(path)) == split.classes[label]


def test_classes_are_sorted_folder_names_and_extensions_match_in_any_case(tmp_path):
    make_folder(tmp_path, {"zinnia": 3}, suffix=".JPG")
    make_folder(tmp_path, {"aster": 3}, suffix=".Png")
    make_folder(tmp_path, {"iris": 3}, suffix=".webp")
    (tmp_path / "iris" / "notes.txt").touch()
    (tmp_path / "README.md").touch()
    split = read_split_data(tmp_path)
    assert split.classes == ["aster", "iris", "zinnia"]
    assert len(split.train_images) + len(split.val_images) == 9


def test_class_indices_json_is_written_into_the_output_dir_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = make_folder(tmp_path / "data", {"tulips": 4, "daisy": 4})
    read_split_data(root, output_dir=tmp_path / "run")
    assert json.loads((tmp_path / "run" / "class_indices.json").read_text()) == {"0": "daisy", "1": "tulips"}
    assert not (tmp_path / "class_indices.json").exists()
    read_split_data(root)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run"]


@pytest.mark.parametrize(
    "layout, message",
    [
        ("missing", "does not exist"),
        ("file", "is a file"),
        ("no_classes", "no class sub-folders"),
        ("empty_class", "holds no readable images"),
        ("one_image", "at least 2"),
    ],
)
def test_unusable_data_folders_are_user_errors(tmp_path, layout, message):
    root = tmp_path / "data"
    if layout == "file":
        root.write_text("not a folder")
    elif layout == "no_classes":
        root.mkdir()
        (root / "a.jpg").touch()
    elif layout == "empty_class":
        make_folder(root, {"daisy": 3})
        (root / "roses").mkdir()
    elif layout == "one_image":
        make_folder(root, {"daisy": 3, "roses": 1})
    with pytest.raises(UserError, match=message):
        read_split_data(root)
