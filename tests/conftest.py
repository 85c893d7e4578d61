"""Shared test fixtures and helpers: small generated datasets, running the scripts as a user would, reading runs.

Writing a test: a test that starts no script and trains nothing belongs to the fast tier (mark it, or its file,
`@pytest.mark.fast`; `pytest -m fast` runs that tier in under a minute). Make data with `tiny_data` or
`make_demo_data`, run a script as a user would with `run_script`, check refused input with `assert_user_error`;
tests/wiring.py builds loaders and models as the scripts do. The parallel machinery is at the end of this file;
a new test does not need it.
"""

import contextlib
import importlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dataset.demo import make_demo_data  # noqa: E402
from dataset.store import STORE_ENV  # noqa: E402
from machine import available_cores, cpu_bfloat16  # noqa: E402

# What auto would measure (autotune/choose.py), pinned, so that no test run spends time measuring unless it
# tests measuring: the precision and layout the suite has always trained in (bfloat16 where the CPU computes it
# natively, NCHW at its 32 px), no loader worker, and the batches made on the device (the CPU here: the scripts'
# path on a GPU; the tests of the loader's path give --batches loader).
PINNED_COMPUTE = ["--amp", "bf16" if cpu_bfloat16()[0] else "off", "--no-channels-last"]
PINNED = [*PINNED_COMPUTE, "--workers", "0", "--batches", "device"]
# Settings that make a training run take seconds: tiny images, small batches, nothing measured, and ResNet-18:
# what the runs test (launching, resuming, failing, seeding) does not depend on the network's depth, and ResNet-34's
# 85 MB of weights make every checkpoint, optimizer step and gradient all-reduce twice as long. The tests that are
# about ResNet-34 itself (tests/test_model.py, the GPU tests) build it as the scripts do.
SMALL_MODEL = ["--model", "resnet18"]
FAST = ["--img-size", "32", "--batch-size", "8", *SMALL_MODEL, *PINNED]
FAULTS = ROOT / "tests" / "fault_injection"
REFERENCE_FLAGS = ("--epochs", "4", "--seed", "0", *FAST)
# A run stopped after its first of 2 epochs (stopped_run); a test resuming it gives the same flags.
STOPPED_FLAGS = ("--epochs", "2", *FAST)
# Two DDP epochs in float32 on any CPU (--amp off: bfloat16 where native would make runs differ between machines), of
# a network that draws at random (MobileNetV3-Small's dropout): the DDP runs' comparisons (torchrun against spawn,
# two nodes against one, stopped by a real signal and resumed) then hold for each rank's own draws too. Their batches
# are streamed from the image store (--device-images-gb 0: none held), so the guarantees of the DDP runs hold on the
# streamed path, and their comparisons with one process's runs (held) across the two paths.
DDP_MODEL = "mobilenet_v3_small"
DDP_FLAGS = ("--epochs", "2", "--device", "cpu", "--seed", "3", *FAST, "--amp", "off", "--model", DDP_MODEL,
             "--device-images-gb", "0")  # fmt: skip


def fault_env(fault: str | None = None) -> dict:
    """Environment for a run: a unique marker to find its processes by, and optionally an injected fault
    (see tests/fault_injection/sitecustomize.py, e.g. "raise:0:2": rank 0 fails at the start of epoch 2)."""
    env = {"RUN_MARKER": uuid.uuid4().hex, "PYTHONPATH": f"{FAULTS}{os.pathsep}{ROOT}"}
    if fault:
        env["FAULT"] = fault
    return env


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment carries RUN_MARKER=marker (workers, loader workers, launchers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"RUN_MARKER={marker}".encode() in (proc / "environ").read_bytes():
                if (proc / "stat").read_text().split(")")[-1].split()[0] != "Z":  # zombies have already exited
                    found.append(int(proc.name))
        except OSError:
            pass
    return found


def run_nodes(start, logs: list[Path], timeout: float, check: bool = True) -> list[str]:
    """Start one process per log file, start(rank, log_file), as the nodes of one job, and wait for all of them
    (within `timeout` seconds); any still running on the way out is stopped. Fails the test unless every one
    exited 0 (with check=False: unless every one exited); returns each one's output."""
    deadline = time.monotonic() + timeout
    nodes = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as log_file:
                nodes.append(start(rank, log_file))
        for node in nodes:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.terminate()  # torchrun stops its worker (in a session of its own) and exits
        for node in nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    outputs = [log.read_text() for log in logs]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0 or not check and node.returncode > 0, output  # < 0: stopped here, by a signal
    return outputs


def script_command(script: str, *args, launcher=()) -> list[str]:
    return [sys.executable, *launcher, str(ROOT / script), *map(str, args)]


def run_script(script: str, *args, launcher=(), cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run one of the repository's scripts in a fresh interpreter, as a user would from a shell."""
    return subprocess.run(
        script_command(script, *args, launcher=launcher),
        cwd=cwd or ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def run_main(capsys):
    """Call a script's main in this process, with a command line, for input it refuses before training: the
    same entry point and error line as run_script, without starting an interpreter that imports torch anew
    (6-7 s on a 2-core CPU). Returns what run_script returns; fails the test if the script does not exit."""

    def call(script: str, *args) -> subprocess.CompletedProcess:
        module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
        with pytest.raises(SystemExit) as exit_info:
            module.main([str(arg) for arg in args])
        printed = capsys.readouterr()
        return subprocess.CompletedProcess([script, *args], exit_info.value.code, printed.out, printed.err)

    return call


def run_here(script: str, *args) -> subprocess.CompletedProcess:
    """A script's run called in this process, with a command line: what run_script returns, without the 5-6 s of
    a new interpreter importing torch (on a worker's one core). For runs whose start is not what is tested (a
    resume after a failure, a run in a folder a refusal left); run_script for the first start of each kind."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main([str(arg) for arg in args])
            code = 0
        except SystemExit as exit:
            code = exit.code or 0
    return subprocess.CompletedProcess([script, *map(str, args)], code, out.getvalue(), err.getvalue())


def assert_user_error(result, fragment: str):
    """Bad input: exit status 2 and one line on stderr, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def final_weights(out: Path) -> dict:
    """The weights of a run's last epoch."""
    return torch.load(out / "weights" / "last.pth", weights_only=True)


TIMINGS = ("train_seconds", "validation_seconds", "logging_seconds", "saving_seconds")  # where an epoch's time went


def metrics_without_timings(out: Path) -> list[dict]:
    """A run's metrics.jsonl, without the numbers that differ from run to run (timings, memory)."""
    timings = {"epoch_seconds", "train_images_per_sec", "peak_rss_mib", "peak_gpu_mib", *TIMINGS}
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timings} for line in lines]


def torchrun(nproc: int) -> tuple[str, ...]:
    """torchrun arguments; --standalone makes it choose a free port, so tests never collide."""
    return ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc))


@pytest.fixture(scope="session")
def tiny_data(shared_tmp) -> Path:
    """5 classes x 12 JPEGs of 48x40 pixels: enough for a run to go through every step, not to learn."""
    return made_once(shared_tmp, "tiny_data", lambda folder: make_demo_data(folder, images_per_class=12, size=(48, 40)))


@pytest.fixture(scope="session")
def learnable_data(shared_tmp) -> Path:
    """5 classes x 80 demo JPEGs: a 6-epoch run at 32 px learns well above chance (0.69 and 0.68 at seeds 0 and 1;
    at 48 px, 0.65-0.75, in half as many seconds again)."""
    return made_once(shared_tmp, "learnable_data", lambda folder: make_demo_data(folder, images_per_class=80))


@pytest.fixture(scope="session")
def trained_run(learnable_data, shared_tmp):
    """One short single-process run on learnable_data (6 epochs at 32 px): its folder and the finished process.

    Shared by every test that needs a trained model (predict, evaluate, plots), so the suite trains it once.
    """

    def make(folder):
        out = folder / "run"
        result = run_here(  # in the process of the xdist worker that asks first: training is what it is for
            "train_single_gpu.py",
            *("--data-path", learnable_data, "--output-dir", out, "--img-size", "32", "--batch-size", "32"),
            *("--epochs", "6", "--lr", "0.01", *SMALL_MODEL, *PINNED),
        )
        assert result.returncode == 0, result.stderr
        return out, result

    return made_once(shared_tmp, "trained_run", make)


@pytest.fixture(scope="session")
def torchrun_run(tiny_data, shared_tmp):
    """torchrun with 2 processes on tiny_data (DDP_FLAGS): the finished process and its run folder. Its image store
    is its own (in stores/ beside the run folder: built by this run), and each image decoded for it is logged in
    decodes/ there (DECODE_LOG: one file per rank)."""

    def make(folder):
        (folder / "decodes").mkdir(parents=True)
        env = fault_env() | {"DECODE_LOG": str(folder / "decodes"), STORE_ENV: str(folder / "stores")}
        return finished_run(folder, "train_multi_gpu_using_launch.py", tiny_data, launcher=torchrun(2), env=env)

    return made_once(shared_tmp, "torchrun_run", make)


@pytest.fixture(scope="session")
def stopped_torchrun_run(tiny_data, shared_tmp):
    """torchrun_run's command, tracked in a SQLite file, stopped by SIGTERM to torchrun in its second epoch (rank 0
    sends it at step 1: tests/fault_injection), every rank and loader checked gone: (the finished process, its run
    folder, a copy of the folder as the stop left it, the tracker's URI). test_tracking continues the run in its
    folder, tracked; test_preemption resumes copies of it, untracked (the copy names the tracked run, and a resume
    without a tracker leaves it alone)."""

    uri = f"sqlite:///{shared_tmp / 'stopped_torchrun_run' / 'mlflow.db'}"  # beside the run folder

    def make(folder):
        out, env = folder / "run", fault_env("stop:1:1:TERM")
        folder.mkdir(parents=True)
        stopped = run_script(
            "train_multi_gpu_using_launch.py", "--data-path", tiny_data, *DDP_FLAGS, "--output-dir", out,
            "--tracking-uri", uri, launcher=torchrun(2), env=env, timeout=240,
        )  # fmt: skip
        assert "stopped by SIGTERM at epoch 1, step" in stopped.stdout + stopped.stderr, stopped.stderr
        assert not processes_with(env["RUN_MARKER"])  # every rank and loader exited
        shutil.copytree(out, folder / "as_stopped")
        return stopped, out, folder / "as_stopped"

    return (*made_once(shared_tmp, "stopped_torchrun_run", make), uri)


@pytest.fixture(scope="session")
def taken_port():
    """A TCP port something listens on, for the whole session: where another job holds MASTER_PORT."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.fixture(scope="session")
def spawn_run(tiny_data, shared_tmp, taken_port):
    """The spawn script with 2 processes on tiny_data (DDP_FLAGS), started with MASTER_PORT set to a port that is
    taken, as when another job holds it: it must choose another and train as usual. The port it was given is in
    master_port.txt beside the run folder (the xdist worker that made the run held it; the others hold others)."""

    def make(folder):
        folder.mkdir(parents=True)
        (folder / "master_port.txt").write_text(str(taken_port))
        env = {"MASTER_PORT": str(taken_port)}
        return finished_run(folder, "train_multi_gpu_using_spawn.py", tiny_data, "--world-size", "2", env=env)

    return made_once(shared_tmp, "spawn_run", make)


@pytest.fixture(scope="session")
def reference_run(tiny_data, shared_tmp):
    """One uninterrupted single-process run on tiny_data, 4 epochs, seed 0 (REFERENCE_FLAGS): its folder. Runs
    that must end bitwise like it (the same seed again, a killed and resumed run) use the same flags."""

    def make(folder):
        out = folder / "run"
        result = run_here("train_single_gpu.py", *REFERENCE_FLAGS, "--data-path", tiny_data, "--output-dir", out)
        assert result.returncode == 0, result.stderr
        return out

    return made_once(shared_tmp, "reference_run", make)


@pytest.fixture(scope="session")
def stopped_run(tiny_data, shared_tmp):
    """A single-process run on tiny_data (STOPPED_FLAGS: 2 epochs) that stopped after its first epoch's checkpoint
    (an injected failure at the start of epoch 1), as after a crash: its folder. Shared by the tests that resume it
    or refuse to: each works on its own copy (copy_run), so that the suite trains it once."""

    def make(folder):
        out = folder / "run"
        stopped = run_script(
            "train_single_gpu.py", "--data-path", tiny_data, *STOPPED_FLAGS, "--output-dir", out,
            env=fault_env("raise:0:1"),
        )  # fmt: skip
        assert stopped.returncode != 0 and "injected failure on rank 0 at epoch 1" in stopped.stderr, stopped.stderr
        assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == 0
        return out

    return made_once(shared_tmp, "stopped_run", make)


def finished_run(folder: Path, script: str, data: Path, *flags, **options):
    """A DDP script on `data` with DDP_FLAGS and `flags` into folder/run (run_script's `options`), checked to end
    well: (the finished process, the run folder)."""
    out = folder / "run"
    result = run_script(script, "--data-path", data, "--output-dir", out, *DDP_FLAGS, *flags, **options)
    assert result.returncode == 0, result.stderr
    return result, out


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of the run folder `run` at tmp_path/run, for a test to resume or change on its own."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# ---------------------------------------------------------------------------------------------------------------
# How the suite runs in parallel. A new test needs none of this: use the fixtures and helpers above.

# The suite runs in parallel with pytest-xdist (pyproject.toml: -n auto --dist loadfile): each test file in one
# worker process, so a file's module fixtures are made once; the session fixtures that train are shared between
# the workers (made_once). Each worker keeps an equal share of the cores, and every script it starts inherits it:
# the scripts size their threads by the cores they may use, so the workers never run more threads than there are
# cores (on 2 cores, oversubscribed training threads wait on each other and a step takes ten times as long).
MAX_WORKERS = 4  # beyond it the suite gains little (its longest file takes about a minute) and memory grows


@pytest.hookimpl(optionalhook=True)  # an xdist hook: -n auto's number of workers
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, available_cores()))


# The workers take the files in the order of the collection (pytest_configure turns off xdist's own order, by
# number of tests, which started the one-test files, two of the longest, last of all), and a worker takes the next
# file when its own are nearly done: the longest files first, longest first, so that the workers end together.
# By each file's seconds on one worker (one core) of a 2-worker run, its shared runs included (2026-11-24, after the
# runs moved to ResNet-18: both workers ended within a second of each other); the files not named follow in name
# order.
LONGEST_FIRST = (
    "test_guarantees_on_avx2.py",  # 170 s
    "test_failures.py",  # 160 s, reference_run and stopped_run included
    "test_training.py",  # 130 s, trained_run, torchrun_run and spawn_run included (files after it share them)
    "test_preemption.py",  # 105 s, with reference_run, torchrun_run and spawn_run
    "test_multinode.py",  # 95 s, with torchrun_run
    "test_scoring.py",  # 80 s, with torchrun_run: predict.py and evaluate.py launched under torchrun and spawn
    "test_recipe_runs.py",  # 80 s
    "test_equivalence.py",  # 70 s
    "test_portability.py",  # 60 s
    "test_benchmark.py",  # 55 s
    "test_filesystem.py",  # 40 s
    "test_run_folder.py",  # 40 s, with stopped_run
    "test_tracking.py",  # 40 s, with reference_run: torchrun, then two resumes in its worker's process
)


def pytest_collection_modifyitems(items):
    def place(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=place)  # a stable sort: each file's tests, and the files not named, keep their order


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # -n 0, or xdist's controller, which hands out the files
        config.option.loadscopereorder = False  # in the order pytest_collection_modifyitems sets (xdist 3.6+)
        return
    if not hasattr(os, "sched_setaffinity"):
        return  # a platform without CPU affinity
    cores, index = sorted(os.sched_getaffinity(0)), int(config.workerinput["workerid"].removeprefix("gw"))
    per_worker = max(1, len(cores) // int(config.workerinput["workercount"]))  # equal shares: equal thread counts
    share = cores[index * per_worker : (index + 1) * per_worker] or cores[index % len(cores) :][:1]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))  # tests that train in this process, too


@pytest.fixture(scope="session", autouse=True)
def files_of_this_session(tmp_path_factory, shared_tmp):
    """What the runs leave besides their run folders is kept in this session's folder, never in the user's cache:
    what a run measures (in the tests of measuring); the image stores, shared by the session's workers (the runs of
    one folder map one store, as on a user's machine); and each torchrun's folder of logs and error files, which it
    would otherwise make in /tmp and leave there (torchrun reads --log-dir from PET_LOG_DIR). Every script a test
    starts inherits the settings."""
    from autotune.remembered import CACHE_ENV  # here: xdist's controller, which loads this file too, imports no model

    os.environ[CACHE_ENV] = str(tmp_path_factory.getbasetemp() / "autotune.json")
    os.environ[STORE_ENV] = str(shared_tmp / "image_stores")
    os.environ["PET_LOG_DIR"] = str(tmp_path_factory.getbasetemp() / "torchrun_logs")


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory, pytestconfig) -> Path:
    """A folder of this test session that all its xdist workers share (each worker's own tmp folders are in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(pytestconfig, "workerinput") else base


def made_once(shared_tmp: Path, name: str, make):
    """`make(folder)`'s result for the folder shared_tmp/name (which make creates), made once per session: by the
    first xdist worker that asks, while any other that asks waits for it (a file lock) and then reads the result
    it saved. `make` returns a path or a finished process (subprocess.CompletedProcess), or a tuple of them."""
    folder, saved = shared_tmp / name, shared_tmp / f"{name}.json"
    with FileLock(shared_tmp / f"{name}.lock"):
        if not saved.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
            saved.write_text(json.dumps(to_json(make(folder))))
    return from_json(json.loads(saved.read_text()))


def to_json(value):
    if isinstance(value, tuple):
        return [to_json(item) for item in value]
    if isinstance(value, Path):
        return {"path": str(value)}
    return {"returncode": value.returncode, "args": value.args, "stdout": value.stdout, "stderr": value.stderr}


def from_json(value):
    if isinstance(value, list):
        return tuple(from_json(item) for item in value)
    if "path" in value:
        return Path(value["path"])
    return subprocess.CompletedProcess(value["args"], value["returncode"], value["stdout"], value["stderr"])
