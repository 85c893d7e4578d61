"""Windows and macOS, as far as Linux can stand in for them.

Two kinds of test. A Windows-like Python (tests/windows_like/sitecustomize.py: no `fcntl`, no `resource`, new
processes started by `spawn`) trains with each script. And the decisions that depend on the platform (device,
backend, precision, loader workers, what a checkpoint keeps) are checked with torch's answers on a Mac or on Windows
substituted for this machine's. Neither is a real Windows or Mac: mps kernels never run here, and NCCL's absence
is torch saying so, not a Windows build of torch.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from conftest import PINNED_COMPUTE, ROOT, SMALL_MODEL, assert_user_error, run_script
from torch import nn

import machine
import utils
from autotune.choose import amp_candidates, compute_candidates
from dataset.sampling import step_seed
from multi_train_utils.bookkeeping import EpochBooks
from multi_train_utils.checkpoint import load_checkpoint, restore, save_atomically, training_state
from multi_train_utils.distributed_utils import MPS_IN_DDP, init_distributed_mode, resolve_device, single_process
from multi_train_utils.train_eval_utils import Choice, Training
from run.metrics import peak_memory
from utils import UserError, write_atomically

WINDOWS_LIKE = {"PYTHONPATH": f"{ROOT / 'tests' / 'windows_like'}{os.pathsep}{ROOT}"}
# One epoch of tiny images, with one loader worker per loader: a worker process started by spawn.
ONE_EPOCH = ["--img-size", "32", "--batch-size", "8", "--epochs", "1", "--device", "cpu", "--workers", "1"]
ONE_EPOCH += [*SMALL_MODEL, *PINNED_COMPUTE]  # nothing left to measure (autotune/choose.py)
MPS, CPU = torch.device("mps"), torch.device("cpu")


@pytest.fixture
def mac(monkeypatch):
    """torch's answers on a Mac with Apple silicon: no CUDA, an mps device, no NCCL in its build."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)


def pretend_one_cuda_gpu(monkeypatch, nccl: bool) -> None:
    """torch's answers on a machine with one NVIDIA GPU, with or without NCCL in its build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


@pytest.fixture
def windows_with_cuda(monkeypatch):
    """torch's answers on Windows with one NVIDIA GPU: CUDA, but no NCCL in its build."""
    monkeypatch.setattr(sys, "platform", "win32")
    pretend_one_cuda_gpu(monkeypatch, nccl=False)


@pytest.fixture
def linux_with_cuda(monkeypatch):
    """torch's answers on Linux with one NVIDIA GPU and NCCL."""
    pretend_one_cuda_gpu(monkeypatch, nccl=True)


@pytest.fixture
def joins(monkeypatch):
    """The keyword arguments of every init_process_group call; none forms a group."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return calls


@pytest.fixture
def mac_with_cuda_forbidden(mac, monkeypatch):
    """A Mac (see `mac`) on which calling a torch.cuda function the project uses fails the test, and whose mps
    generator is a stand-in that records the seeds it is given (the list returned), as no mps generator exists
    here."""

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"torch.cuda.{name} called on the mps path")

        return call

    for name in (
        "is_available", "device_count", "set_device", "get_device_capability", "max_memory_allocated",
        "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "synchronize", "manual_seed",
    ):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    seeds = []
    monkeypatch.setattr(torch.mps, "manual_seed", seeds.append)
    return seeds


@pytest.mark.fast
def test_the_windows_like_python_has_no_fcntl_nor_resource_and_starts_processes_by_spawn():
    code = (
        "import importlib.util, multiprocessing\n"
        "for name in ('fcntl', 'resource'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print(name, 'imported')\n"
        "    except ModuleNotFoundError:\n"
        "        print(name, 'missing')\n"
        "print(multiprocessing.get_start_method())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **WINDOWS_LIKE}, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split("\n") == ["fcntl missing", "resource missing", "spawn", ""], result.stderr


def test_every_script_imports_in_a_windows_like_python():
    scripts = ("train_single_gpu", "train_multi_gpu_using_launch", "train_multi_gpu_using_spawn", "predict", "evaluate")
    code = f"import {', '.join(scripts)}, export, plot_results"
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **WINDOWS_LIKE}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def windows_like_run(script: str, data, out, *flags) -> list[dict]:
    """Run `script` in the Windows-like Python for ONE_EPOCH on `data`; its metrics.jsonl lines."""
    result = run_script(script, "--data-path", data, "--output-dir", out, *ONE_EPOCH, *flags, env=WINDOWS_LIKE)
    assert result.returncode == 0, result.stderr
    assert "1 loader workers per process" in result.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_no_peak_memory_unless_psutil(metrics: list[dict]) -> None:
    """Without `resource`, peak_rss_mib comes from psutil, which the requirements do not install."""
    has_psutil = importlib.util.find_spec("psutil") is not None
    assert all(("peak_rss_mib" in line) == has_psutil for line in metrics)


def test_a_windows_like_python_trains_in_one_process(tiny_data, tmp_path):
    metrics = windows_like_run("train_single_gpu.py", tiny_data, tmp_path / "run")
    assert [line["epoch"] for line in metrics] == [0] and metrics[0]["world_size"] == 1
    assert (tmp_path / "run" / "weights" / "last.pth").is_file() and (tmp_path / "run" / "checkpoint.pth").is_file()
    assert_no_peak_memory_unless_psutil(metrics)


def test_a_windows_like_python_trains_with_the_spawn_script(tiny_data, tmp_path):
    metrics = windows_like_run("train_multi_gpu_using_spawn.py", tiny_data, tmp_path / "run", "--world-size", "2")
    assert [line["epoch"] for line in metrics] == [0] and metrics[0]["world_size"] == 2
    assert (tmp_path / "run" / "weights" / "last.pth").is_file() and (tmp_path / "run" / "checkpoint.pth").is_file()
    assert_no_peak_memory_unless_psutil(metrics)


@pytest.mark.fast
def test_a_mac_without_cuda_trains_on_mps_by_default(mac):
    assert resolve_device(None) == MPS


@pytest.mark.fast
def test_device_mps_is_accepted_in_one_process(mac):
    process = single_process("mps")
    assert process.device == MPS and not process.distributed


@pytest.mark.fast
def test_device_mps_is_refused_where_torch_finds_no_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device mps asked for a Mac's GPU .* use --device cpu"):
        resolve_device("mps")


@pytest.mark.fast
@pytest.mark.parametrize("device", ["mps", None])
def test_ddp_on_a_mac_trains_on_the_cpu_with_gloo_and_says_why_once(mac, joins, capsys, device):
    processes = [init_distributed_mode(device, rank=rank, world_size=2) for rank in (0, 1)]
    assert [process.device for process in processes] == [CPU, CPU]
    assert [join["backend"] for join in joins] == ["gloo", "gloo"]
    assert capsys.readouterr().out.splitlines() == [MPS_IN_DDP]  # rank 0's line alone


@pytest.mark.fast
def test_windows_with_cuda_uses_gloo(windows_with_cuda, joins):
    process = init_distributed_mode(None, rank=0, world_size=1)
    assert process.device == torch.device("cuda", 0)
    assert joins[0]["backend"] == "gloo" and "device_id" not in joins[0]


@pytest.mark.fast
@pytest.mark.parametrize(("asked", "backend", "binds"), [(None, "nccl", True), ("gloo", "gloo", False)])
def test_init_process_group_is_given_the_device_for_nccl_alone(linux_with_cuda, joins, asked, backend, binds):
    init_distributed_mode("cuda", backend=asked, rank=0, world_size=1)
    assert joins[0]["backend"] == backend
    assert joins[0].get("device_id", "not given") == (torch.device("cuda", 0) if binds else "not given")


@pytest.mark.fast
@pytest.mark.parametrize("platform", ["windows_with_cuda", "mac"])
def test_dist_backend_nccl_is_refused_in_one_line_where_torch_has_no_nccl(platform, request, joins, run_main):
    request.getfixturevalue(platform)
    result = run_main("train_multi_gpu_using_spawn.py", "--dist-backend", "nccl", "--device", "cpu")
    assert_user_error(result, "--dist-backend nccl: this torch has no NCCL")
    assert joins == []  # refused before any process joins a group


@pytest.mark.fast
def test_training_on_mps_seeds_the_mps_generator_each_step_and_calls_no_cuda_function(
    mac_with_cuda_forbidden, tmp_path
):
    seeds = mac_with_cuda_forbidden

    def model_and_training(seed):
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)  # a CPU model: only the device the run names is mps
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, Training(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))

    model, training = model_and_training(0)
    seeds.clear()  # torch.manual_seed's
    assert [step for step, _ in EpochBooks(training, [None] * 3, MPS, epoch=2).steps()] == [0, 1, 2]
    assert seeds == [step_seed(0, 2, step, 0) for step in range(3)]  # the step's own seed, on the mps generator
    save_atomically(training_state(4, model, training, 0.5, ["a", "b"], 1, {"device": "mps"}), tmp_path / "c.pth")
    resumed_model, resumed_training = model_and_training(1)
    assert restore(load_checkpoint(tmp_path / "c.pth"), resumed_model, resumed_training) == (5, 0.5)
    assert torch.equal(resumed_model.weight, model.weight)


@pytest.mark.fast
def test_peak_memory_on_mps_calls_no_cuda_function(mac_with_cuda_forbidden):
    assert peak_memory(MPS).keys() == {"peak_rss_mib"}


@pytest.mark.fast
def test_amp_auto_on_mps_is_float32_and_says_why_while_the_layout_is_measured(mac_with_cuda_forbidden):
    assert amp_candidates("auto", MPS) == (["off"], "--amp auto: autocast on mps is not measured here")
    assert compute_candidates("auto", None, MPS) == [Choice("off", channels_last=False), Choice("off", True)]


@pytest.mark.fast
def test_loader_workers_on_mps_are_as_on_a_gpu(monkeypatch):
    monkeypatch.setattr(machine, "available_cores", lambda: 4)
    mps_workers = machine.core_budget(MPS, 1, 32)[0]
    assert mps_workers == machine.core_budget(torch.device("cuda"), 1, 32)[0] == 4
    assert machine.core_budget(CPU, 1, 32)[0] == 0  # on the CPU the cores compute


@pytest.mark.fast
def test_peak_memory_is_left_out_where_neither_resource_nor_psutil_exists(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)  # None in sys.modules: its import fails
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert peak_memory(CPU) == {}


@pytest.mark.fast
def test_peak_memory_on_windows_is_psutils_peak_working_set(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)
    memory = types.SimpleNamespace(rss=10 * 2**20, peak_wset=300 * 2**20)  # psutil's fields on Windows
    fake_psutil = types.SimpleNamespace(Process=lambda: types.SimpleNamespace(memory_info=lambda: memory))
    monkeypatch.setitem(sys.modules, "psutil", fake_psutil)
    assert peak_memory(CPU) == {"peak_rss_mib": 300}


@pytest.mark.fast
def test_atomic_writes_on_windows_do_not_open_the_folder(monkeypatch, tmp_path):
    def windows_open(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", str(path))  # what Windows answers for a folder
        return os.open(path, flags, *args, **kwargs)

    # Windows' os as utils sees it (os.name itself must stay: pathlib and pytest read it)
    windows_os = types.ModuleType("os")
    windows_os.__dict__.update(vars(os), name="nt", open=windows_open)
    monkeypatch.setattr(utils, "os", windows_os)
    write_atomically(tmp_path / "metrics.jsonl", lambda f: f.write("{}\n"))
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"
