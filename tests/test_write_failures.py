"""Every place the program writes, driven through a filesystem that fails: a folder it may not write (read-only), a
disk that fills up (full), a folder removed while the program writes there (removed). Each failure is one line naming
the place and the cause (utils.writing's OutputError; the tracker's one warning; the image store's line, its images
then read from their files), never a traceback (docs/resuming-and-failures.md, "A write fails").

The filesystem fails for real: modes (chmod, and where the suite runs as root, whom modes do not stop, this thread's
CAP_DAC_OVERRIDE lowered meanwhile: Linux's own check then applies, to the threads started inside too), the kernel's
file-size limit (RLIMIT_FSIZE: writes fail with EFBIG as on a full disk they fail with ENOSPC), and folders removed.
"""

import contextlib
import ctypes
import importlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import STOPPED_FLAGS, run_here

from dataset.demo import make_demo_data
from dataset.store import StoredImages
from run.config import Config
from run.tensorboard import Board
from run.tracking import Tracking
from tools import script_rows
from tools.profile_steps import TRACE_NAME, traced
from utils import OutputError, write_json

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux's modes, capabilities and file-size limit")

CAP_DAC_OVERRIDE = 1  # the capability that lets root write where modes forbid it (linux/capability.h)


class CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapabilitySets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def allow_writing_anywhere(allowed: bool) -> None:
    """Raise or lower this thread's effective CAP_DAC_OVERRIDE (capset(2) on the calling thread alone)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, sets = CapabilityHeader(0x20080522, 0), (CapabilitySets * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capget(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    bit = 1 << CAP_DAC_OVERRIDE
    sets[0].effective = sets[0].effective | bit if allowed else sets[0].effective & ~bit
    if libc.capset(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capset")


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` (made if need be) and everything in it read-only to this thread and the threads it starts."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder, *folder.rglob("*")]
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in paths}
    for path in paths:
        path.chmod(modes[path] & ~0o222)
    root = os.geteuid() == 0
    if root:
        allow_writing_anywhere(False)
    try:
        yield
    finally:
        if root:
            allow_writing_anywhere(True)
        for path in paths:
            path.chmod(modes[path])


@contextlib.contextmanager
def full(folder: Path, most: int = 4096):
    """No file of this process may grow beyond `most` bytes (small outputs, and pytest's own capture, fit)."""
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (most, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)


@contextlib.contextmanager
def removed(folder: Path):
    shutil.rmtree(folder)
    yield


FAILURES = {"read-only": (read_only, "Permission denied"), "full": (full, "File too large"),
            "removed": (removed, "No such file or directory")}  # fmt: skip


def preview_set() -> list:
    """16 validation images as a run's Board takes them (uint8, channels first), labelled 0, 1, 0, 1, ..."""
    return [(torch.full((3, 16, 16), 15 * i, dtype=torch.uint8), i % 2) for i in range(16)]


def tensorboard(folder: Path, failing) -> None:
    """A run's TensorBoard file: made, then its epoch written as the filesystem fails."""
    board = Board(folder, Config().record(), preview_set(), 0)
    metrics = {"epoch": 0, "train_loss": 1.0, "val_acc": 0.5, "lr": 0.1}
    with failing(folder):
        board.epoch(metrics, 0.5, [0, 1] * 8, ["a", "b"])


def tensorboard_made(folder: Path, failing) -> None:
    """A run's TensorBoard file made as the filesystem fails."""
    folder.mkdir()
    with failing(folder):
        Board(folder, Config().record(), preview_set(), 0)


def run_file(folder: Path, failing) -> None:
    """A file of the run (args.json, metrics.jsonl, a checkpoint: utils.write_atomically), replaced."""
    write_json(folder / "args.json", {"epochs": 1})
    with failing(folder):
        write_json(folder / "args.json", {"epochs": 2, "notes": "x" * 10_000})


def demo_data(folder: Path, failing) -> None:
    """--demo's images, written into the project's data folder (a hidden folder, then renamed)."""
    folder.mkdir()
    with failing(folder):
        make_demo_data(folder / "demo", images_per_class=2, size=(320, 240), photo_like=True)  # (grain: 20 kB)


def profile_trace(folder: Path, failing) -> None:
    """tools/profile_steps.py's trace, written once its steps are traced."""
    folder.mkdir()

    def loop(batches) -> None:
        for _ in batches:
            torch.ones(256, 256) @ torch.ones(256, 256)

    with failing(folder):
        traced(loop, iter(range(100)), 0, 4, torch.device("cpu"), folder)


def benchmark_log(folder: Path, failing) -> None:
    """A benchmark row's log (tools/script_rows.py), which the script it runs writes into."""
    (folder / "logs").mkdir(parents=True)
    with failing(folder / "logs"):
        script_rows.logged_run(SimpleNamespace(output_dir=folder), "auto", [sys.executable, "-c", "print('row')"])


# Each place: how it writes, the failures it meets, the place its line names. (TensorBoard's writer thread, started
# with the file, may write where this thread may not: read-only is tried as the file is made.)
WRITES = {
    "TensorBoard's epoch": (tensorboard, ("full", "removed"), "{folder}"),
    "TensorBoard's file": (tensorboard_made, ("read-only",), "{folder}"),
    "a file of the run": (run_file, ("read-only", "full"), "{folder}/args.json"),
    "the demo data": (demo_data, ("read-only", "full"), "{folder}/demo"),
    "the profile's trace": (profile_trace, ("read-only", "full", "removed"), f"{{folder}}/{TRACE_NAME}"),
    "a benchmark row's log": (benchmark_log, ("read-only",), "{folder}/logs/auto.log"),
}
CASES = [(place, failure) for place, (_, failures, _) in WRITES.items() for failure in failures]
# torch's profiler writes its trace into a temporary file first, from C++, which says only that it failed
CAUSES = {("the profile's trace", "full"): "torch's profiler could not write it whole"}
# What torch's profiler (kineto) logs as it starts and stops, failing or not: its lines, not the program's
KINETO_LOG = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\] ")


@pytest.mark.fast
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a thread's traceback, under pytest
@pytest.mark.parametrize("place, failure", CASES, ids=[f"{place}, {failure}" for place, failure in CASES])
def test_a_write_that_fails_is_one_line_naming_the_place_and_the_cause(place, failure, tmp_path, capfd):
    write, _, named = WRITES[place]
    failing, cause = FAILURES[failure]
    folder = tmp_path / "out"
    with pytest.raises(OutputError) as refused:
        write(folder, failing)
    cause = CAUSES.get((place, failure), cause)
    assert str(refused.value).startswith(f"cannot write {named.format(folder=folder)}: {cause}"), refused.value
    for thread in threading.enumerate():  # a writer thread that failed ends: its traceback, were it printed, is out
        if getattr(thread, "exception", None) is not None:  # (TensorBoard's keeps its failure there)
            thread.join(10)
    printed = [line for line in capfd.readouterr().err.splitlines() if not KINETO_LOG.match(line)]
    assert not printed  # no thread's traceback, nothing else


@pytest.mark.fast
@pytest.mark.parametrize("failure", ["read-only", "full"])
def test_an_image_store_that_cannot_be_written_is_one_line_and_the_images_are_read_from_their_files(failure, tmp_path):
    failing, cause = FAILURES[failure]
    paths = [str(path) for path in sorted(make_demo_data(tmp_path / "data", 1, size=(64, 48)).rglob("*.jpg"))]
    folder = tmp_path / "stores"
    images = StoredImages(folder, [40, 36], None, fallback=lambda images: ["checked by the fallback"])
    with failing(folder):
        assert images(paths) == ["checked by the fallback"] and images.path is None  # no store: the run's ImageCheck
    assert images.line == (
        f"Images: decoded from their files every epoch: no image store could be made ({folder}: {cause})"
    )


def tracker_in(folder: Path, uri: str) -> Tracking:
    """A run's Tracking in `folder` (holding its args.json), tracked at `uri`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "args.json").write_text("{}")
    plan = SimpleNamespace(output_dir=folder, tracked_run=None)
    return Tracking(Config(tracking_uri=uri), plan, Config().record(), torch.device("cpu"))


@pytest.mark.parametrize("store", ["a SQLite file", "a folder"])
def test_a_tracker_in_a_folder_it_may_not_write_costs_one_warning(store, tmp_path, capsys, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    where = tmp_path / "tracker"
    uri = f"sqlite:///{where / 'mlflow.db'}" if store == "a SQLite file" else str(where / "mlruns")
    tracking = tracker_in(tmp_path / "run", uri)
    with read_only(where):  # the tracking thread starts inside: it may not write there either
        tracking.start([], 0)
        tracking.epoch({"epoch": 0, "train_loss": 1.0, "val_acc": 0.5, "lr": 0.1, "world_size": 1})
        tracking.end("FINISHED")
    (line,) = capsys.readouterr().err.splitlines()  # neither MLflow's log lines nor a traceback
    assert line.startswith(f"warning: MLflow tracking at {uri} failed (") and "the run goes on untracked" in line
    assert tracking.checkpoint_entry() == {}


@pytest.mark.fast
@pytest.mark.parametrize("tool", ["tools/benchmark.py", "tools/profile_steps.py"])
def test_a_tool_whose_output_folder_is_read_only_says_so_in_one_line_before_it_measures(
    tool, tiny_data, tmp_path, run_main
):
    out = tmp_path / "out"
    flags = {
        "tools/benchmark.py": ("--data-path", tiny_data, "--output-dir", out, "--rows", "profile"),
        "tools/profile_steps.py": ("--trace-dir", out, "train_single_gpu.py", "--data-path", tiny_data),
    }
    with read_only(out):
        refused = run_main(tool, *flags[tool])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr == f"error: cannot write the output folder {out}: Permission denied ({out})\n"
    assert not refused.stdout and list(out.iterdir()) == []  # nothing measured, nothing written


def test_a_run_whose_folder_is_removed_stops_in_one_line_and_the_command_it_advises_starts_it_again(
    tiny_data, tmp_path, monkeypatch
):
    script, out = importlib.import_module("train_single_gpu"), tmp_path / "run"
    flags = ("--data-path", tiny_data, *STOPPED_FLAGS, "--epochs", "1", "--output-dir", out)
    real_train_one_epoch = script.train_one_epoch

    def removed_as_it_trains(*args, **options):  # as a cleaning job would, the run's TensorBoard file open
        shutil.rmtree(out)
        return real_train_one_epoch(*args, **options)

    with monkeypatch.context() as patch:
        patch.setattr(script, "train_one_epoch", removed_as_it_trains)
        stopped = run_here("train_single_gpu.py", *flags)
    assert stopped.returncode == 2, stopped.stderr
    (line,) = stopped.stderr.splitlines()  # not TensorBoard's thread's traceback, nor ours
    assert line.startswith(f"error: cannot write {out / 'tb'}: No such file or directory; stopped, {out} holds no ")
    advised = line.split("run the same command with ")[1].split()
    assert advised == ["--auto-resume", "--output-dir", str(out)]

    again = run_here("train_single_gpu.py", *flags, *advised)
    assert again.returncode == 0, again.stderr
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]
