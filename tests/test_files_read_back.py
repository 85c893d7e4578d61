"""Every file the project reads back is checked where it is read (issue 32). Damage to a cache (autotune.json,
checked_images.json) costs a measuring or a check again, with one warning, and the file is replaced by a good one;
damage to a run's record (checkpoint.pth, args.json, metrics.jsonl, a weights file) is refused with one UserError
naming the file, and nothing is rewritten. Never a traceback.

Each file is made as the project writes it, then damaged by Hypothesis: cut short at any length, a byte flipped, or
one part of its content, at any depth, replaced by JSON of any shape (or, in an object, left out)."""

import contextlib
import functools
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dataset.demo import make_demo_data
from dataset.folders import read_split_data, split_fingerprint, write_class_indices
from dataset.image_check import CHECKED_IMAGES, ImageCheck
from model import create_model
from multi_train_utils.checkpoint import save_atomically, training_state
from multi_train_utils.stop_and_resume import resume_from
from multi_train_utils.train_eval_utils import Training
from recipe.config import Config
from recipe.optimizer import build_optimizer
from run import autotune
from run.autotune import Choice, cached_or_measured, read_entries
from run.metrics import METRICS_NAME, append_metrics, keep_metrics_before
from run.plan import RUN_LOCK, hold_run_folder, prepare
from run.trained import load_trained_model
from utils import UserError, write_json

pytestmark = pytest.mark.fast
CPU = torch.device("cpu")
EXAMPLES = settings(max_examples=25, derandomize=True, deadline=None, database=None)
SLOW_EXAMPLES = settings(EXAMPLES, max_examples=12)  # each one loads a network's weights

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@dataclass(frozen=True)
class Damage:
    """A file's bytes after damage, and how: "cut" short at `at` bytes, a byte "flipped" at `at`, or "reshaped"."""

    how: str
    data: bytes
    at: int = 0


@st.composite
def reshaped(draw, value, depth: int = 99, inside: bool = False):
    """`value` with one part of it, `depth` levels down at most, replaced by JSON of any shape or (in an object)
    left out; all of it replaced, unless `inside` (a part inside it, then)."""
    if isinstance(value, dict | list) and value and depth > 0 and (inside or draw(st.booleans())):
        key = draw(st.sampled_from(list(value) if isinstance(value, dict) else range(len(value))))
        changed = dict(value) if isinstance(value, dict) else list(value)
        if isinstance(value, dict) and draw(st.booleans()):
            del changed[key]
        else:
            changed[key] = draw(reshaped(value[key], depth - 1))
        return changed
    return draw(JSON)


def damaged(original: bytes, content=None):
    """Damage to a file of bytes `original`: cut short, a byte flipped, or, for a JSON file (its `content`),
    replaced by JSON of any shape or reshaped inside."""
    cut = st.integers(0, len(original) - 1).map(lambda n: Damage("cut", original[:n], n))
    flipped = st.tuples(st.integers(0, len(original) - 1), st.integers(1, 255)).map(
        lambda flip: Damage("flipped", flip_byte(original, *flip), flip[0])
    )
    if content is None:
        return cut | flipped
    other = st.one_of(JSON, reshaped(content, inside=True))
    return cut | flipped | other.map(lambda value: Damage("reshaped", json.dumps(value).encode()))


def flip_byte(data: bytes, at: int, bits: int) -> bytes:
    return data[:at] + bytes([data[at] ^ bits]) + data[at + 1 :]


def cut_inside_json(damage: Damage, original: bytes) -> bool:
    """Whether the damage cut a JSON file before its closing bracket: no whole JSON is left."""
    return damage.how == "cut" and damage.at < len(original.rstrip())


@contextlib.contextmanager
def damaged_copy(name: str, damage: Damage):
    """A fresh folder holding only `name`, damaged."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / name).write_bytes(damage.data)
        yield Path(folder)


def warnings_of(call):
    """(what call() returns, the warning lines it printed on stderr)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        result = call()
    return result, [line for line in stderr.getvalue().splitlines() if line.startswith("warning:")]


def assert_refused_naming(call, name: str) -> bool:
    """call() either works or raises a UserError naming the file `name`; whether it was refused."""
    try:
        call()
    except UserError as error:
        assert name in str(error) and "\n" not in str(error), str(error)
        return True
    return False


# Caches: measured or checked again, with one warning, and replaced


AUTO = Config(model="resnet18", img_size=32, batch_size=8, workers=0)
MEASURED = Choice("off", False, 0, {"fp32": 100.0}, None, 0.5, "2026-11-24", ("Auto: measured",))


@pytest.fixture(scope="module")
def autotune_file(tmp_path_factory):
    """An autotune.json as a run on this machine leaves it (for AUTO, with MEASURED), and the plan it is for."""
    folder = tmp_path_factory.mktemp("autotune")
    plan = SimpleNamespace(data_path=folder / "data", split=SimpleNamespace(classes=list("abcde")))
    with mock.patch.object(autotune, "cache_file", return_value=folder / "autotune.json"):
        with mock.patch.object(autotune, "measure", return_value=MEASURED):
            cached_or_measured(AUTO, plan, CPU, 1, None)
    return (folder / "autotune.json").read_bytes(), plan


@given(data=st.data())
@EXAMPLES
def test_a_damaged_autotune_cache_is_measured_again_with_one_warning_and_replaced(autotune_file, data):
    original, plan = autotune_file
    damage = data.draw(damaged(original, json.loads(original)))
    with damaged_copy("autotune.json", damage) as folder, mock.patch.object(autotune, "cache_file") as cache:
        path = cache.return_value = folder / "autotune.json"
        with mock.patch.object(autotune, "measure", return_value=MEASURED) as measure:
            choice, warnings = warnings_of(lambda: cached_or_measured(AUTO, plan, CPU, 1, None))
            assert (choice.amp, choice.channels_last, choice.workers) == ("off", False, 0)
            assert len(warnings) <= 1 and all("autotune.json" in line for line in warnings)
            if cut_inside_json(damage, original):
                assert len(warnings) == 1 and measure.called
            assert len(read_entries(path)) >= 1  # replaced by a whole file, or left whole
            again, warnings = warnings_of(lambda: cached_or_measured(AUTO, plan, CPU, 1, None))
            assert again.amp == "off" and not warnings and measure.call_count <= 1


@pytest.fixture(scope="module")
def image_check_file(tmp_path_factory):
    """A data folder of 10 images, and the checked_images.json a run's check of them leaves."""
    folder = tmp_path_factory.mktemp("image_check")
    make_demo_data(folder / "data", images_per_class=2, size=(16, 16))
    images = sorted(str(path) for path in (folder / "data").rglob("*.jpg"))
    check = ImageCheck(folder / "data", folder)
    check(images)
    check.save(folder)
    return (folder / CHECKED_IMAGES).read_bytes(), folder / "data", images


@pytest.mark.parametrize("shared", [False, True], ids=["one-process", "ranks-sharing-the-check"])
@given(data=st.data())
@EXAMPLES
def test_a_damaged_image_check_cache_is_checked_again_with_one_warning_and_replaced(image_check_file, shared, data):
    original, root, images = image_check_file
    damage = data.draw(damaged(original, json.loads(original)))
    with damaged_copy(CHECKED_IMAGES, damage) as folder:
        check = ImageCheck(root, folder, shared=shared)  # shared: read again under the lock, where it warns
        unreadable, warnings = warnings_of(lambda: check(images))
        assert unreadable == []  # every image is readable, whatever the file said
        assert len(warnings) <= 1 and all(CHECKED_IMAGES in line for line in warnings)
        if cut_inside_json(damage, original):
            assert len(warnings) == 1 and check.decoded == len(images)
        check.save(folder)
        again = ImageCheck(root, folder)
        assert warnings_of(lambda: again(images)) == ([], []) and again.decoded == 0  # replaced by a good file


# A run's record: refused in one line naming the file, and nothing rewritten


def tiny_training() -> Training:
    """A run's model and what trains it, as the scripts build them, on a network of one layer."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return Training(model, *build_optimizer(model, Config(epochs=2, weight_decay=1e-4), 1))


@pytest.fixture(scope="module")
def checkpoint_state():
    """A checkpoint's state as a run saves it after its first epoch, with its record and split."""
    split = {"train_images": 8, "train_sha256": "a" * 64, "val_images": 2, "val_sha256": "b" * 64}
    record = Config(epochs=2).record(world_size=1, recipe_world_size=1, split=split)
    training = tiny_training()
    return training_state(0, training.model, training, 0.5, ["a", "b"], 1, record)


def resume(path: Path):
    """stop_and_resume.resume_from, as a training script calls it: the checkpoint read and put back."""
    training = tiny_training()
    return resume_from(path, training.model, training, epochs=2)


@given(data=st.data())
@EXAMPLES
def test_a_damaged_checkpoint_is_refused_naming_it(checkpoint_state, data):
    buffer = io.BytesIO()
    torch.save(checkpoint_state, buffer)
    original = buffer.getvalue()
    damage = data.draw(damaged(original))
    with damaged_copy("checkpoint.pth", damage) as folder:
        refused = assert_refused_naming(
            lambda: warnings_of(lambda: resume(folder / "checkpoint.pth")), "checkpoint.pth"
        )
        assert refused or damage.how == "flipped"  # a flip inside a tensor's bytes reads as another number
        assert (folder / "checkpoint.pth").read_bytes() == damage.data


@given(data=st.data())
@EXAMPLES
def test_a_checkpoint_whose_entries_have_other_shapes_is_refused_naming_it(checkpoint_state, data):
    state = data.draw(reshaped(checkpoint_state, depth=3, inside=True))
    with tempfile.TemporaryDirectory() as folder:
        save_atomically(state, Path(folder) / "checkpoint.pth")
        assert_refused_naming(lambda: warnings_of(lambda: resume(Path(folder) / "checkpoint.pth")), "checkpoint.pth")


EPOCHS = [{"epoch": epoch, "train_loss": 1.5 - epoch, "val_acc": 0.25 * epoch, "lr": 0.01} for epoch in range(2)]


@pytest.fixture(scope="module")
def metrics_file(tmp_path_factory):
    """A metrics.jsonl of two epochs, as run_log writes it."""
    path = tmp_path_factory.mktemp("metrics") / METRICS_NAME
    for metrics in EPOCHS:
        append_metrics(path, metrics)
    return path.read_bytes()


def damaged_lines(original: bytes):
    """Damage to a JSON Lines file: to its bytes (damaged), or one line reshaped."""
    lines = original.splitlines(keepends=True)

    def with_line(i: int, value) -> Damage:
        return Damage("reshaped", b"".join([*lines[:i], json.dumps(value).encode() + b"\n", *lines[i + 1 :]]))

    one_line = st.integers(0, len(lines) - 1).flatmap(
        lambda i: reshaped(json.loads(lines[i])).map(lambda value: with_line(i, value))
    )
    return damaged(original) | one_line


def cut_inside_a_line(damage: Damage, original: bytes) -> bool:
    """Whether the damage cut a line of a JSON Lines file before its closing bracket."""
    ends = [i for i, byte in enumerate(original) if byte == ord("\n")]
    starts = [0, *(end + 1 for end in ends[:-1])]
    return damage.how == "cut" and any(start < damage.at < end - 1 for start, end in zip(starts, ends, strict=True))


@pytest.mark.parametrize(
    "rewrite",
    [functools.partial(keep_metrics_before, epoch=1), functools.partial(append_metrics, metrics=EPOCHS[-1])],
    ids=["resumed", "an-epoch-added"],
)
@given(data=st.data())
@EXAMPLES
def test_a_damaged_metrics_file_is_refused_naming_it_and_left_as_it_was(metrics_file, rewrite, data):
    damage = data.draw(damaged_lines(metrics_file))
    with damaged_copy(METRICS_NAME, damage) as folder:
        refused = assert_refused_naming(lambda: rewrite(folder / METRICS_NAME), METRICS_NAME)
        assert refused or not cut_inside_a_line(damage, metrics_file)
        if refused:
            assert (folder / METRICS_NAME).read_bytes() == damage.data


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder as a training run leaves it, of a small network: weights/best.pth, class_indices.json and
    args.json."""
    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    save_atomically(create_model(2, "squeezenet1_1").state_dict(), folder / "weights" / "best.pth")
    write_class_indices(["a", "b"], folder)
    write_json(folder / "args.json", Config(model="squeezenet1_1", amp="off").record(channels_last=False))
    return folder


def predict_from(folder: Path):
    """What predict.py, evaluate.py and export.py do first: the run's model, from its weights and files."""
    return load_trained_model(folder / "weights" / "best.pth", None, CPU)


@contextlib.contextmanager
def run_with(run_folder: Path, name: str, damage: Damage):
    """A copy of `run_folder` with its file `name` damaged."""
    with tempfile.TemporaryDirectory() as copy:
        for path in run_folder.rglob("*"):
            if path.is_file():
                (Path(copy) / path.relative_to(run_folder)).parent.mkdir(parents=True, exist_ok=True)
                (Path(copy) / path.relative_to(run_folder)).write_bytes(path.read_bytes())
        (Path(copy) / name).write_bytes(damage.data)
        yield Path(copy)


@given(data=st.data())
@SLOW_EXAMPLES
def test_a_damaged_run_flags_file_is_refused_naming_it(run_folder, data):
    original = (run_folder / "args.json").read_bytes()
    damage = data.draw(damaged(original, json.loads(original)))
    with run_with(run_folder, "args.json", damage) as folder:
        refused = assert_refused_naming(lambda: predict_from(folder), "args.json")
        assert refused or not cut_inside_json(damage, original)


@given(data=st.data())
@SLOW_EXAMPLES
def test_a_damaged_weights_file_is_refused_naming_it(run_folder, data):
    original = (run_folder / "weights" / "best.pth").read_bytes()
    damage = data.draw(damaged(original))
    with run_with(run_folder, "weights/best.pth", damage) as folder:
        refused = assert_refused_naming(lambda: predict_from(folder), "best.pth")
        assert refused or damage.how == "flipped"  # a flip inside a tensor's bytes reads as another number


@pytest.mark.parametrize("damage", [b'{"epoch": 0, "train_loss": 1.5}\n{"epo', b"\x00\xff", b"[1, 2]\n"])
def test_a_resume_whose_metrics_file_is_damaged_is_refused_before_anything_is_written(tmp_path, damage):
    data = make_demo_data(tmp_path / "data", images_per_class=4, size=(16, 16))
    run = tmp_path / "run"
    config = Config(data_path=data, output_dir=run, auto_resume=True, epochs=2, batch_size=2, img_size=16)
    split = read_split_data(data, config.val_rate, config.seed, verify_images=False)
    record = config.record(world_size=1, recipe_world_size=1, split=split_fingerprint(split, data))
    training = tiny_training()
    save_atomically(training_state(0, training.model, training, 0.5, split.classes, 1, record), run / "checkpoint.pth")
    write_json(run / "args.json", record)
    (run / METRICS_NAME).write_bytes(damage)
    before = {path.name: path.read_bytes() for path in run.iterdir()}
    with pytest.raises(UserError, match=METRICS_NAME):
        warnings_of(lambda: prepare(config, world_size=1))
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.name != RUN_LOCK} == before


def test_a_run_lock_that_is_a_folder_is_refused_naming_it(tmp_path):
    (tmp_path / RUN_LOCK).mkdir()
    with pytest.raises(UserError, match=RUN_LOCK):
        hold_run_folder(tmp_path)
