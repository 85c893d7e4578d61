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
import struct
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import evaluate
from autotune import choose as autotune
from autotune import remembered
from autotune.choose import compute_candidates, remembered_or_measured
from autotune.remembered import read_entries
from autotune.timing import Measured
from dataset.demo import make_demo_data
from dataset.folders import read_split_data, split_fingerprint, write_class_indices
from dataset.image_check import CHECK_LOCK, CHECKED_IMAGES, ImageCheck, read_verdicts
from inference.trained import load_trained_model
from multi_train_utils.checkpoint import load_checkpoint, save_atomically, training_state
from multi_train_utils.stop_and_resume import resume_from
from multi_train_utils.train_eval_utils import Choice, Training
from network.architectures import create_model
from read_back import safe_load
from recipe.optimizer import build_optimizer
from run.config import Config
from run.folder_lock import RUN_LOCK, hold_run_folder
from run.metrics import METRICS_NAME, append_metrics, keep_metrics_before
from run.plan import prepare
from run.tracking import TRACKED_RUN_NAME, read_tracked_run
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


def tensor_data(original: bytes) -> list[range]:
    """Where the tensors' bytes lie in a file torch.save wrote: the data of its zip records archive/data/N."""
    spans = []
    with zipfile.ZipFile(io.BytesIO(original)) as archive:
        for record in archive.infolist():
            if "/data/" in record.filename and record.file_size:
                name_length, extra_length = struct.unpack("<HH", original[record.header_offset + 26 :][:4])
                start = record.header_offset + 30 + name_length + extra_length  # after the record's local header
                spans.append(range(start, start + record.file_size))
    return spans


def flipped(original: bytes):
    """A file torch.save wrote with one byte flipped: half the time inside a tensor's bytes, else anywhere."""
    inside = st.sampled_from(tensor_data(original)).flatmap(lambda span: st.integers(span.start, span.stop - 1))
    at = st.one_of(inside, st.integers(0, len(original) - 1))
    return st.tuples(at, st.integers(1, 255)).map(lambda flip: Damage("flipped", flip_byte(original, *flip), flip[0]))


def saved_bytes(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def same(loaded, saved) -> bool:
    """Whether `loaded` holds exactly what `saved` does: the same tensors (dtype, shape and every bit), the same
    plain values, in the same containers."""
    if isinstance(saved, torch.Tensor):
        return isinstance(loaded, torch.Tensor) and loaded.dtype == saved.dtype and torch.equal(loaded, saved)
    if isinstance(saved, dict):
        return (
            isinstance(loaded, dict) and loaded.keys() == saved.keys() and all(same(loaded[k], saved[k]) for k in saved)
        )
    if isinstance(saved, list | tuple):
        return type(loaded) is type(saved) and len(loaded) == len(saved) and all(map(same, loaded, saved))
    return type(loaded) is type(saved) and loaded == saved


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
MEASURED = Measured({Choice("off", False): 100.0}, ["Auto: measured"])  # measure's answer: float32 NCHW, the fastest


def measured_or_remembered(plan) -> Choice:
    """autotune's choice for AUTO: remembered, else measured (MEASURED, substituted) and remembered."""
    candidates = compute_candidates(AUTO.amp, AUTO.channels_last, CPU)
    return remembered_or_measured(AUTO, plan, CPU, 1, None, 0, None, candidates)


@pytest.fixture(scope="module")
def autotune_file(tmp_path_factory):
    """An autotune.json as a run on this machine leaves it (for AUTO, with MEASURED), and the plan it is for."""
    folder = tmp_path_factory.mktemp("autotune")
    plan = SimpleNamespace(data_path=folder / "data", split=SimpleNamespace(classes=list("abcde")))
    with mock.patch.object(remembered, "cache_file", return_value=folder / "autotune.json"):
        with mock.patch.object(autotune, "measure", return_value=MEASURED):
            measured_or_remembered(plan)
    return (folder / "autotune.json").read_bytes(), plan


@given(data=st.data())
@EXAMPLES
def test_a_damaged_autotune_cache_is_measured_again_with_one_warning_and_replaced(autotune_file, data):
    original, plan = autotune_file
    damage = data.draw(damaged(original, json.loads(original)))
    with damaged_copy("autotune.json", damage) as folder, mock.patch.object(remembered, "cache_file") as cache:
        path = cache.return_value = folder / "autotune.json"
        with mock.patch.object(autotune, "measure", return_value=MEASURED) as measure:
            choice, warnings = warnings_of(lambda: measured_or_remembered(plan))
            assert (choice.amp, choice.channels_last, choice.workers) == ("off", False, 0)
            assert len(warnings) <= 1 and all("autotune.json" in line for line in warnings)
            if cut_inside_json(damage, original):
                assert len(warnings) == 1 and measure.called
            assert len(read_entries(path)) >= 1  # replaced by a whole file, or left whole
            again, warnings = warnings_of(lambda: measured_or_remembered(plan))
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


def test_evaluate_checks_a_damaged_image_check_cache_again_warns_once_and_replaces_it(image_check_file, tmp_path):
    original, root, images = image_check_file
    run = tmp_path / "run"
    run.mkdir()
    (run / CHECKED_IMAGES).write_bytes(original[: len(original) // 2])
    trained = SimpleNamespace(run_folder=run, classes=sorted(path.name for path in root.iterdir()))
    trained.setting = lambda name, given: given
    args = SimpleNamespace(data_path=root, val_rate=0.5, seed=0, output_dir=tmp_path / "eval", all=False)
    args.weights = run / "weights" / "best.pth"
    warnings = warnings_of(lambda: evaluate.plan(args, trained))[1]
    assert len(warnings) == 1 and CHECKED_IMAGES in warnings[0]
    assert read_verdicts(run) == json.loads(original)["images"]  # replaced, as a training run replaces it
    assert warnings_of(lambda: evaluate.plan(args, trained))[1] == []
    (run / CHECKED_IMAGES).unlink()  # weights beside no image check: evaluate.py makes none
    assert warnings_of(lambda: evaluate.plan(args, trained))[1] == [] and not (run / CHECKED_IMAGES).exists()


def test_an_image_check_lock_that_is_a_folder_is_refused_naming_it(image_check_file, tmp_path):
    _, root, images = image_check_file
    (tmp_path / CHECK_LOCK).mkdir()
    with pytest.raises(UserError, match=f"{CHECK_LOCK}: Is a directory .*: remove it and run again"):
        ImageCheck(root, tmp_path, shared=True)(images)  # as torchrun's ranks check the images, sharing the check


TRACKED_RUN = {"tracking_uri": "http://127.0.0.1:5000", "run_id": "3f2a9c6d0b1e4f5a8c7d6e5f4a3b2c1d"}


@pytest.fixture(scope="module")
def tracked_run_file(tmp_path_factory):
    """A tracked_run.json as a tracked run's start writes it."""
    path = tmp_path_factory.mktemp("tracked") / TRACKED_RUN_NAME
    write_json(path, TRACKED_RUN)
    return path.read_bytes()


@given(data=st.data())
@EXAMPLES
def test_a_damaged_tracked_run_file_is_one_warning_and_a_new_tracked_run(tracked_run_file, data):
    damage = data.draw(damaged(tracked_run_file, TRACKED_RUN))
    with damaged_copy(TRACKED_RUN_NAME, damage) as folder:
        entry, warnings = warnings_of(lambda: read_tracked_run(folder))
        if entry is None:
            assert len(warnings) == 1 and TRACKED_RUN_NAME in warnings[0] and "tracking as a new run" in warnings[0]
        else:  # damage that leaves a run id (the tracker's address changed, say): that run is continued
            assert warnings == [] and isinstance(entry["run_id"], str)
        if cut_inside_json(damage, tracked_run_file):
            assert entry is None
        assert (folder / TRACKED_RUN_NAME).read_bytes() == damage.data


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
        assert refused or damage.how == "flipped"  # outside every record's CRC-32: the same tensors (below)
        assert (folder / "checkpoint.pth").read_bytes() == damage.data


@given(data=st.data())
@EXAMPLES
def test_a_checkpoint_with_a_byte_flipped_is_refused_or_loads_the_saved_tensors(checkpoint_state, data):
    original = saved_bytes(checkpoint_state)
    damage = data.draw(flipped(original))
    with damaged_copy("checkpoint.pth", damage) as folder:
        loaded = []
        refused = assert_refused_naming(
            lambda: loaded.append(load_checkpoint(folder / "checkpoint.pth")), "checkpoint.pth"
        )
        assert refused or same(loaded[0], checkpoint_state)  # a flip that no record's CRC-32 covers changes nothing
        assert (folder / "checkpoint.pth").read_bytes() == damage.data


def test_a_byte_flipped_in_a_tensors_data_is_refused_naming_the_file_and_its_record(checkpoint_state, tmp_path):
    original = saved_bytes(checkpoint_state)
    span = tensor_data(original)[0]
    (tmp_path / "checkpoint.pth").write_bytes(flip_byte(original, (span.start + span.stop) // 2, 0x01))
    refusal = r"checkpoint .*checkpoint.pth is damaged \(its record 'archive/data/0' fails .*CRC.*\): restore it"
    with pytest.raises(UserError, match=refusal):
        load_checkpoint(tmp_path / "checkpoint.pth")


def test_a_tensors_record_marked_as_a_folder_is_refused(checkpoint_state, tmp_path):
    # A bit of the record's entry in the zip directory, which no CRC-32 covers: torch.load reads a record marked as
    # a folder as no bytes, and leaves its tensor holding whatever memory it was given.
    original = saved_bytes(checkpoint_state)
    with zipfile.ZipFile(io.BytesIO(original)) as archive:
        entry = original.index(b"PK\x01\x02", archive.start_dir)  # archive/data/0's entry in the directory
        while not original[entry + 46 :].startswith(b"archive/data/0"):
            entry = original.index(b"PK\x01\x02", entry + 1)
    (tmp_path / "checkpoint.pth").write_bytes(flip_byte(original, entry + 38, 0x10))  # its MS-DOS folder bit
    with pytest.raises(UserError, match=r"checkpoint.pth is damaged \(its record 'archive/data/0' is marked as a"):
        load_checkpoint(tmp_path / "checkpoint.pth")


@pytest.mark.parametrize("written", ["without CRCs", "in the format before torch 1.6"])
def test_a_file_without_crcs_loads_as_saved(checkpoint_state, tmp_path, written):
    path = tmp_path / "checkpoint.pth"
    if written == "without CRCs":
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(checkpoint_state, path)
        finally:
            torch.serialization.set_crc32_options(True)
        assert {record.CRC for record in zipfile.ZipFile(path).infolist()} == {0}
    else:
        torch.save(checkpoint_state, path, _use_new_zipfile_serialization=False)
    assert same(load_checkpoint(path), checkpoint_state)


@pytest.mark.parametrize(
    "content, kind",
    [
        (b"not weights\n", "a text file, beginning 'not weights"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00", "a JPEG image"),
        (b"", "it is empty"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{}      ", "a safetensors file"),
    ],
    ids=["text", "jpeg", "empty", "safetensors"],
)
def test_a_file_that_is_no_pytorch_file_is_named_as_such(tmp_path, content, kind):
    (tmp_path / "w.pth").write_bytes(content)
    with pytest.raises(UserError) as refusal:
        safe_load(tmp_path / "w.pth", "weights file")
    assert str(refusal.value).startswith(f"weights file {tmp_path / 'w.pth'} is not a PyTorch file ({kind}")
    assert "safe loader" not in str(refusal.value)


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
def test_a_damaged_weights_file_is_refused_naming_it_or_loads_the_saved_tensors(run_folder, data):
    original = (run_folder / "weights" / "best.pth").read_bytes()
    damage = data.draw(damaged(original) | flipped(original))
    with run_with(run_folder, "weights/best.pth", damage) as folder:
        trained = []
        refused = assert_refused_naming(lambda: trained.append(predict_from(folder)), "best.pth")
        saved = torch.load(io.BytesIO(original), weights_only=True)
        assert refused or same(trained[0].model.state_dict(), saved)  # a flip no record's CRC-32 covers: no change


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
