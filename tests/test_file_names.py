"""File names as the filesystem gives them (issue 45). On Linux a name is any bytes but "/" and NUL, and zip files
from Windows or an old Mac, NAS copies and old archives leave names that are not UTF-8: Python holds each such
byte as a lone surrogate (os.fsdecode). Names drawn by Hypothesis, as bytes, go through the listing, the split,
training, predict.py's and evaluate.py's results and the run's output, and come out as the same bytes; every file
written is what the docs say it is, UTF-8 that Python's own readers read, as docs/trained-models.md shows.

macOS and Windows keep names in Unicode and refuse such bytes: there the tests skip."""

import contextlib
import csv
import io
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import FAST, ROOT
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

import evaluate
import predict
import train_single_gpu
from dataset.folders import read_split_data, split_fingerprint
from inference.results import Row, read_results, results_file
from utils import entry_point

# (the output's capture fixtures are read out before each use: what an example before printed is left behind)
EXAMPLES = settings(
    max_examples=25, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip
RUNS = settings(EXAMPLES, max_examples=2, phases=[Phase.generate])  # each one trains, predicts and evaluates; a
# failing one is shown as it is drawn (shrinking it would train a hundred times)

# A name as a POSIX filesystem takes it: 1 to 255 bytes, no "/" and no NUL; not hidden (a leading "." is left out
# of the listing, as .git is)
NAME = st.binary(min_size=1, max_size=12).map(lambda name: name.replace(b"/", b"|").replace(b"\0", b"~"))
NAME = NAME.map(lambda name: b"_" + name if name.startswith(b".") else name)
NOT_UTF8 = NAME.filter(lambda name: not is_utf8(name))  # as a Windows zip leaves "caf\xe9"


def is_utf8(name: bytes) -> bool:
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_as_the_docs_say(path: Path):
    """A JSON, JSON Lines or CSV file read as UTF-8 with the standard library (UnicodeDecodeError where it is not)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text, newline="")))
    return json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()]


def documented_reading() -> str:
    """docs/trained-models.md's code that reads a results file: the block after "The file is UTF-8"."""
    page = (ROOT / "docs" / "trained-models.md").read_text(encoding="utf-8")
    return page[page.index("The file is UTF-8") :].split("```python\n", 1)[1].split("```", 1)[0]


def image_bytes(colour: int) -> bytes:
    """A small JPEG of one colour."""
    out = io.BytesIO()
    Image.new("RGB", (12, 10), (colour, 255 - colour, colour // 2)).save(out, "JPEG")
    return out.getvalue()


def make_folder(root: Path, data, per_class: tuple[int, int], classes=NAME) -> dict[bytes, bytes]:
    """A class-per-folder data set under `root` whose class folders (2 or 3, drawn from `classes`) and image names
    Hypothesis draws, as bytes: {each image's path: its class's name}. Skips the test where the filesystem refuses
    names that are not UTF-8."""
    images = {}
    root_bytes = os.fsencode(root)
    for index, name in enumerate(data.draw(st.lists(classes, min_size=2, max_size=3, unique=True), label="classes")):
        stems = data.draw(st.lists(NAME, min_size=per_class[0], max_size=per_class[1], unique=True), label="images")
        try:
            os.makedirs(os.path.join(root_bytes, name))
        except OSError as error:  # macOS (APFS), Windows: names are Unicode
            pytest.skip(f"this filesystem refuses the name {name!r}: {error}")
        for number, stem in enumerate(stems):
            path = os.path.join(root_bytes, name, stem[:240] + b".jpg")
            with open(path, "wb") as file:
                file.write(image_bytes(40 * index + 9 * number))
            images[path] = name
    return images


@pytest.mark.fast
@EXAMPLES
@given(data=st.data())
def test_any_names_are_listed_split_and_written_back_as_the_same_bytes(data, tmp_path_factory, capsysbinary):
    root = tmp_path_factory.mktemp("names")
    images = make_folder(root, data, (2, 4))
    split = read_split_data(root, 0.5, seed=0)
    assert sorted(split.classes) == sorted(os.fsdecode(name) for name in set(images.values()))
    listed = split.train_images + split.val_images
    assert sorted(os.fsencode(path) for path in listed) == sorted(images)  # every image once, its name unchanged
    labels = split.train_labels + split.val_labels
    assert [os.fsencode(split.classes[label]) for label in labels] == [images[os.fsencode(path)] for path in listed]
    again = read_split_data(root, 0.5, seed=0)
    assert again.val_images == split.val_images and split_fingerprint(again, root) == split_fingerprint(split, root)

    # predict.py's results, CSV and JSON Lines: each path the bytes of the file's name, read back the same
    rows = [Row(path, split.classes[0], [(split.classes[-1], 0.5)], None) for path in listed]
    for suffix in ("csv", "jsonl"):
        with results_file(root / f"results.{suffix}", topk=1) as results:
            results.write(rows)
        assert [row["path"] for row in read_results(root / f"results.{suffix}")] == listed

    # the run's output: a script's lines carry the names as their bytes, into a stream that encodes strictly
    capsysbinary.readouterr()
    entry_point(lambda: print("\n".join(listed)))()
    assert capsysbinary.readouterr().out == b"\n".join(os.fsencode(path) for path in listed) + b"\n"


@pytest.mark.fast
@EXAMPLES
@given(data=st.data())
def test_a_results_file_is_utf8_whose_documented_reading_gives_back_every_name(data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    quoted = NAME.map(lambda name: b'"' + name)  # a cell that starts as an escaped one does
    names = data.draw(st.lists(NAME | quoted | NOT_UTF8, min_size=2, max_size=4, unique=True), label="names")
    texts = [os.fsdecode(name) for name in names]
    rows = [Row(text, texts[-1], [(texts[0], 0.5)]) for text in texts]
    rows.append(Row(texts[1], None, [], f"OSError: cannot read {texts[1]}"))  # a reason naming a file
    for suffix in ("csv", "jsonl"):
        with results_file(folder / f"results.{suffix}", topk=1) as results:
            results.write(rows)
    namespace = {}
    with contextlib.chdir(folder):
        exec(documented_reading(), namespace)
    read = {"csv": namespace["csv_rows"], "jsonl": namespace["jsonl_rows"]}
    for form, first_class in (("csv", lambda row: row["class_1"]), ("jsonl", lambda row: row["classes"][0])):
        assert [os.fsencode(row["path"]) for row in read[form]] == [*names, names[1]], form
        assert [row["true_class"] or None for row in read[form]] == [texts[-1]] * len(names) + [None], form
        assert [first_class(row) for row in read[form][:-1]] == [texts[0]] * len(names), form
        assert read[form][-1]["unreadable"] == f"OSError: cannot read {texts[1]}", form
    assert read_results(folder / "results.csv") == read["jsonl"] == read_results(folder / "results.jsonl")


@RUNS
@given(data=st.data())
def test_a_run_on_any_names_trains_and_scores_each_image_once_under_its_own_bytes(data, tmp_path_factory, capsysbinary):
    root = tmp_path_factory.mktemp("names")
    images = make_folder(root / "data", data, (4, 5), classes=NOT_UTF8)  # (two examples: both of that kind)
    broken = os.path.join(os.fsencode(root / "data"), next(iter(images.values())), data.draw(NOT_UTF8) + b".png")
    with open(broken, "wb") as file:
        file.write(b"not an image")
    out = root / "run"
    capsysbinary.readouterr()
    flags = ("--data-path", root / "data", "--epochs", "1", "--seed", "0", *FAST, "--batch-size", "2",
             "--output-dir", out)  # fmt: skip
    train_single_gpu.main([str(flag) for flag in flags])
    printed = capsysbinary.readouterr().err
    assert b"warning: skipped 1 unreadable image(s): " + broken in printed, printed  # named as it is

    weights = ["--weights", str(out / "weights" / "last.pth"), "--workers", "0"]
    predict.main([*weights, "--results", str(root / "predicted.csv"), str(root / "data")])
    rows = read_results(root / "predicted.csv")
    assert sorted(os.fsencode(row["path"]) for row in rows) == sorted([*images, broken])
    assert [row["unreadable"] is not None for row in rows].count(True) == 1
    evaluate.main([*weights, "--data-path", str(root / "data"), "--all", "--results", str(root / "evaluated.jsonl")])
    rows = read_results(root / "evaluated.jsonl")
    assert sorted(os.fsencode(row["path"]) for row in rows) == sorted([*images, broken])
    classes = images | {broken: os.path.basename(os.path.dirname(broken))}
    assert all(os.fsencode(row["true_class"]) == classes[os.fsencode(row["path"])] for row in rows)
    files = [path for path in root.rglob("*") if path.suffix in (".json", ".jsonl", ".csv")]  # the run's and tools'
    assert {"class_indices.json", "args.json", "metrics.jsonl", "eval.json"} <= {path.name for path in files}
    written = {path.name: read_as_the_docs_say(path) for path in files}  # UTF-8, as JSON, JSON Lines or CSV
    assert sorted(os.fsencode(name) for name in written["class_indices.json"].values()) == sorted(set(images.values()))
    assert (out / "eval" / "confusion_matrix.png").exists() and sys.getfilesystemencoding() == "utf-8"
    capsysbinary.readouterr()  # read: pytest-xdist would ship what is left in the report, and it encodes strictly
