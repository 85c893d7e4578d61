"""On a CUDA GPU: the scripts end to end, run as a user runs them. Skipped where torch sees no GPU.

    python -m pytest tests/test_gpu.py -m gpu -n 0   # or: bash tools/gpu_run.sh (these tests and the GPU benchmark)

Every check goes through the scripts' command lines, in fresh interpreters, on the small generated data of the
other tests (32 px crops, a few epochs). The tests come in two groups, in this order, so that a GPU machine lent for
minutes runs what matters most first (tools/gpu_run.sh runs each group on its own, under its own time limit):

- TestWhatBreaksSilently (-k TestWhatBreaksSilently): what could go wrong on a GPU with no error to show it, sized
  for about three minutes (on one GPU it starts the scripts five times, each for seconds of training). One process
  of each launch mode on the GPU (torchrun and spawn on nccl, with SyncBatchNorm2d), each learning well above chance
  and all three logging the same losses and accuracies; the weights' moving average (--model-ema) updated at every
  step; two ranks sharing one GPU over gloo, so that the multi-rank CUDA paths (SyncBatchNorm's gathers, DDP's
  gradient buckets) run at least once, and their checkpoint resumed in one process; with two GPUs visible, two ranks
  on nccl and --device cuda:1.
- the rest (-k "not TestWhatBreaksSilently"): bf16 and fp16 (with its gradient scaler) on CUDA, channels_last and
  torch.compile there (last: a compilation of a minute or more), checkpoints moving between the GPU and a machine
  without one, predict.py and evaluate.py on CUDA, --data-parallel with one GPU, and a torchrun that cannot put two
  processes on one GPU.

Two ranks on one GPU: in DDP each process takes the GPU of its LOCAL_RANK (resolve_device), so one torchrun with
--nproc_per_node 2 on a one-GPU machine gives rank 1 cuda:1 and it stops (tested below); spawn refuses --world-size
above the GPU count; and nccl refuses two ranks on one device anyway ("Duplicate GPU detected"). What works with
the flags as they are: two torchrun agents of one process each, started as two "nodes" of one job (the README's
multi-machine command, on one machine): each process is LOCAL_RANK 0, so both take cuda:0, with --dist-backend gloo.
"""

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    FAULTS,
    ROOT,
    copy_run,
    fault_env,
    metrics_without_timings,
    run_nodes,
    run_script,
    script_command,
    torchrun,
)
from wiring import planned

from dataset.folders import read_split_data
from dataset.transforms import IMAGENET_STD
from multi_train_utils.distributed_utils import shuffled_batches
from multi_train_utils.spawn_utils import find_free_port
from multi_train_utils.train_eval_utils import Choice
from my_dataset import TrainingBatches, datasets
from read_back import with_weights
from run.config import Config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

TWO_EPOCHS = ("--epochs", "2", "--seed", "0", *FAST, "--model", "resnet34")  # the scripts' network, on the GPU
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # a process that sees no GPU: a machine without one, as far as torch can tell

# Six epochs of the 400 demo flowers (learnable_data) at 32 px, with the weights' moving average: enough to learn well
# above chance (0.2). On the CPU the same command with --device cpu ended at 0.60-0.71 validation accuracy in 9 runs
# (seeds 0-2; bfloat16 and float32, NCHW and channels_last), the average at 0.64-0.69 in the 3 that kept one
# (2026-11-24, 2-core AMD EPYC Zen 4). A GPU's kernels round otherwise, and a few roundings change a short run's path,
# so the GPU runs must only reach LEARNED, well below that and well above chance.
LEARNING_BATCH = 32
LEARNING = (
    "--epochs", "6", "--seed", "0", "--img-size", "32", "--batch-size", str(LEARNING_BATCH), "--lr", "0.01",
    "--model", "resnet34", "--workers", "0", "--model-ema", "--ema-decay", "0.9", "--device", "cuda",
    "--batches", "device",
)  # fmt: skip
LEARNED = 0.45
# One process of each launch mode: the recipe makes them compute the same steps (same seed, shards, batches, rate)
LAUNCH_MODES = {
    "single": ("train_single_gpu.py", (), ()),
    "torchrun": ("train_multi_gpu_using_launch.py", (), torchrun(1)),
    "spawn": ("train_multi_gpu_using_spawn.py", ("--world-size", "1"), ()),
}
TWO_RANKS = {
    "torchrun": ("train_multi_gpu_using_launch.py", (), torchrun(2)),
    "spawn": ("train_multi_gpu_using_spawn.py", ("--world-size", "2"), ()),
}
# A GPU does not promise the same sums twice: cuDNN's benchmark mode (the scripts turn it on: use_device) times
# its algorithms in each process and may choose others, and some kernels add in whatever order their threads
# finish. The probe (below) makes every run take the same deterministic kernels, so that runs computing the same
# steps log the same numbers; CUBLAS_WORKSPACE_CONFIG is what cuBLAS needs for it.
DETERMINISTIC = {"GPU_PROBE_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

# Written into a folder put first on PYTHONPATH: Python imports it at start-up in every process of a run (torchrun's
# agent, its workers, spawn's workers), and it records what torch's DDP and DataLoader and the scripts'
# SyncBatchNorm2d saw there, and at exit what the process allocated on each GPU. It wraps those and sets torch's flags
# (DETERMINISTIC); the scripts are untouched.
PROBE = """
import atexit
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from multi_train_utils import sync_batchnorm

_LOG = os.path.join(os.environ["GPU_PROBE_DIR"], f"{os.getpid()}.jsonl")


def _record(**event):
    with open(_LOG, "a") as log:
        log.write(json.dumps(event) + "\\n")


_ddp_init = nn.parallel.DistributedDataParallel.__init__


def _probed_ddp_init(self, module, *args, **kwargs):
    _ddp_init(self, module, *args, **kwargs)
    kinds = [type(m) for m in module.modules()]
    _record(
        event="ddp", rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend(),
        device=str(next(module.parameters()).device),
        sync_bn=sum(k is sync_batchnorm.SyncBatchNorm2d for k in kinds),
        batch_norm=sum(k is nn.BatchNorm2d for k in kinds),
    )


_global_batch_stats = sync_batchnorm.global_batch_stats
_seen = []


def _probed_global_batch_stats(x):
    if not _seen:  # the first time SyncBatchNorm2d gathers the statistics of every rank's batch
        _seen.append(True)
        _record(
            event="batch_stats_gathered", rank=dist.get_rank(), world_size=dist.get_world_size(),
            backend=dist.get_backend(), device=str(x.device),
        )
    return _global_batch_stats(x)


_loader_init = DataLoader.__init__


def _probed_loader_init(self, *args, **kwargs):
    _loader_init(self, *args, **kwargs)
    _record(event="loader", pin_memory=self.pin_memory, workers=self.num_workers)


def _gpu_memory():
    if torch.cuda.is_initialized():
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # torch's own query; asks, creates none
        gpus = range(torch.cuda.device_count())
        _record(
            event="gpu_memory", peak_bytes=[torch.cuda.max_memory_allocated(i) for i in gpus],
            contexts=[has_context(i) for i in gpus] if has_context else None,
        )


nn.parallel.DistributedDataParallel.__init__ = _probed_ddp_init
sync_batchnorm.global_batch_stats = _probed_global_batch_stats
DataLoader.__init__ = _probed_loader_init
atexit.register(_gpu_memory)

if os.environ.get("GPU_PROBE_DETERMINISTIC"):  # see DETERMINISTIC
    torch.backends.cudnn.deterministic = True
    type(torch.backends.cudnn).benchmark = property(lambda self: False, lambda self, value: None)
    torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that has no such kernel

if os.environ.get("FAULT"):  # tests/fault_injection's faults too: Python imports only the first sitecustomize.py
    _spec = importlib.util.spec_from_file_location("fault_injection", os.environ["GPU_PROBE_FAULTS"])
    sys.modules["fault_injection"] = _faults = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_faults)
"""


def visible_gpus(count: int) -> dict:
    """Environment that shows a process only the first `count` GPUs this one sees (a machine with that many)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": ",".join(seen.split(",")[:count])}


def bf16_is_native() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 0)


def precision_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("Precision:")]
    assert len(lines) == 1, stdout
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_on_cpu(path: Path):
    return with_weights(torch.load(path, weights_only=True, map_location="cpu"), path)  # a checkpoint's, followed


def assert_saved_weights_load_on_the_cpu(out: Path) -> None:
    """The run's last weights load on the CPU (weights_only=True, map_location="cpu"), finite, without wrapper
    prefixes."""
    weights = load_on_cpu(out / "weights" / "last.pth")
    assert weights and all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)


def assert_trained(out: Path, epochs: int = 2, world_size: int = 1, gpu_epochs=None) -> list[dict]:
    """The run's metrics.jsonl has every epoch once, with a finite loss and an accuracy in [0, 1]; the epochs in
    `gpu_epochs` (default: all) trained on CUDA (only CUDA runs log peak_gpu_mib), the others on the CPU; its last
    weights and checkpoint load on the CPU (weights_only=True, map_location="cpu"), finite, without wrapper
    prefixes."""
    lines = metrics(out)
    assert [m["epoch"] for m in lines] == list(range(epochs))
    gpu_epochs = range(epochs) if gpu_epochs is None else gpu_epochs
    for m in lines:
        assert 0.0 <= m["val_acc"] <= 1.0 and math.isfinite(m["train_loss"]) and m["train_loss"] > 0
        assert m["world_size"] == world_size
        assert ("peak_gpu_mib" in m) == (m["epoch"] in gpu_epochs), m
    assert_saved_weights_load_on_the_cpu(out)
    assert load_on_cpu(out / "checkpoint.pth")["epoch"] == epochs - 1
    return lines


def train_single(data, out, *flags, env=None, timeout=300) -> subprocess.CompletedProcess:
    result = run_script(
        "train_single_gpu.py", *TWO_EPOCHS, "--data-path", data, "--output-dir", out, *flags, env=env, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def stopped_after_epoch_0(data, out, *flags, env=None) -> Path:
    """A 2-epoch run that an injected failure stops at the start of epoch 1 (tests/fault_injection): epoch 0's
    checkpoint is on disk, as after a crash."""
    result = run_script(
        "train_single_gpu.py", *TWO_EPOCHS, "--data-path", data, "--output-dir", out, *flags,
        env={**fault_env("raise:0:1"), **(env or {})},
    )  # fmt: skip
    assert result.returncode != 0 and "injected failure" in result.stderr, result.stdout + result.stderr
    assert load_on_cpu(out / "checkpoint.pth")["epoch"] == 0
    return out


def resume(data, checkpoint: Path, *flags, env=None) -> subprocess.CompletedProcess:
    result = run_script(
        "train_single_gpu.py", *TWO_EPOCHS, "--data-path", data, "--resume", checkpoint, *flags, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Resuming from" in result.stdout
    return result


def probe_env(tmp_path: Path) -> tuple[dict, Path]:
    """The environment of a run with the probe (PROBE), and the folder its records go to."""
    code, records = tmp_path / "probe", tmp_path / "probe_records"
    code.mkdir()
    records.mkdir()
    (code / "sitecustomize.py").write_text(PROBE)
    # the project's modules on the path too: the probe wraps one, and a fault injected (FAULT) replaces another
    env = {"PYTHONPATH": f"{code}{os.pathsep}{ROOT}", "GPU_PROBE_DIR": str(records)}
    return env | {"GPU_PROBE_FAULTS": str(FAULTS / "sitecustomize.py")}, records


def probe_records(records: Path, event: str) -> list[dict]:
    lines = [json.loads(line) for log in sorted(records.glob("*.jsonl")) for line in log.read_text().splitlines()]
    return [line for line in lines if line["event"] == event]


def start_node(node_rank: int, port: int, job_id: str, data, out, env: dict, log, *flags) -> subprocess.Popen:
    """One torchrun agent of a 2-node job, one process, as README's multi-machine command starts it."""
    launcher = (
        "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job_id}",
    )  # fmt: skip
    command = script_command(
        "train_multi_gpu_using_launch.py", *TWO_EPOCHS, "--data-path", data, "--output-dir", out,
        "--device", "cuda", "--dist-backend", "gloo", *flags, launcher=launcher,
    )  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )


# ------------------------------------------------------------------------------------ first: what breaks silently


@pytest.fixture(scope="module")
def learning_run(learnable_data, tmp_path_factory):
    """learning_run(mode): one process of launch mode `mode` (LAUNCH_MODES) trained with LEARNING on the GPU, with
    the probe and its deterministic kernels; made on first use, once: (run folder, finished process, probe
    records)."""
    runs = {}

    def run(mode: str):
        if mode not in runs:
            script, flags, launcher = LAUNCH_MODES[mode]
            folder = tmp_path_factory.mktemp(f"learning_{mode}")
            env, records = probe_env(folder)
            precision = ("--amp", "bf16" if bf16_is_native() else "off", "--channels-last")
            result = run_script(
                script, *LEARNING, *precision, "--data-path", learnable_data, "--output-dir", folder / "run", *flags,
                launcher=launcher, env=env | DETERMINISTIC,
            )  # fmt: skip
            runs[mode] = folder / "run", result, records
        return runs[mode]

    return run


@pytest.fixture(scope="module")
def two_ranks_on_one_gpu(tiny_data, tmp_path_factory):
    """Two torchrun agents of one process each (two "nodes" on this machine): both processes are LOCAL_RANK 0 and
    take cuda:0 of the same GPU; gloo carries their collectives (nccl refuses two ranks on one device). With the
    weights' moving average and the probe; rank 0 fails at the start of epoch 1 (an injected fault), after epoch
    0's checkpoint, as after a crash. (run folder, each node's output, probe records)."""
    folder = tmp_path_factory.mktemp("two_ranks")
    env, records = probe_env(folder)
    env |= visible_gpus(1) | {"FAULT": "raise:0:1"}
    out, logs = folder / "run", [folder / f"node{rank}.log" for rank in (0, 1)]
    port, job_id = find_free_port(), f"gpu-{uuid.uuid4().hex[:8]}"

    def start(rank, log):
        return start_node(rank, port, job_id, tiny_data, out, env, log, "--model-ema")

    return out, run_nodes(start, logs, 300, check=False), records


def nondeterminism_warnings(*results: subprocess.CompletedProcess) -> list[str]:
    """The lines in which torch warned that an op ran without a deterministic kernel (under DETERMINISTIC)."""
    return [line for result in results for line in result.stderr.splitlines() if "deterministic" in line]


class TestWhatBreaksSilently:
    """Run first on a lent GPU machine (tools/gpu_run.sh): what could go wrong on a GPU with no error to show it.
    Every launch mode once, on nccl or gloo over CUDA."""

    @pytest.mark.parametrize("mode", LAUNCH_MODES)
    def test_one_process_of_each_launch_mode_learns_on_the_gpu(self, learning_run, mode):
        out, result, records = learning_run(mode)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"1 process(es) on cuda{'' if mode == 'single' else ', backend nccl'}" in result.stdout
        last = assert_trained(out, epochs=6)[-1]
        assert last["val_acc"] >= LEARNED and last["ema_val_acc"] >= LEARNED, last  # the model and its average
        ddp = probe_records(records, "ddp")
        if mode == "single":
            assert ddp == []
        else:
            [ddp] = ddp
            assert ddp["backend"] == "nccl" and ddp["device"] == "cuda:0" and ddp["world_size"] == 1
            assert ddp["sync_bn"] > 0 and ddp["batch_norm"] == 0  # every BatchNorm2d converted to SyncBatchNorm2d
        assert probe_records(records, "loader") == []  # the batches made on the GPU: no DataLoader
        assert "Batches: made on the device (--batches device)" in result.stdout

    def test_one_process_of_every_launch_mode_logs_the_same_losses_and_accuracies(self, learning_run):
        """Epoch by epoch: the training loss (up to float rounding), the model's and its average's validation counts
        (overall and per class), the learning rate and the images trained on."""
        runs = {mode: learning_run(mode) for mode in LAUNCH_MODES}
        for mode, (_, result, _) in runs.items():
            assert result.returncode == 0, (mode, result.stdout + result.stderr)
        logged = {mode: metrics_without_timings(out) for mode, (out, _, _) in runs.items()}
        warned = nondeterminism_warnings(*(result for _, result, _ in runs.values()))
        single = logged.pop("single")
        for mode, lines in logged.items():
            losses = [m.pop("train_loss") for m in lines]
            assert losses == pytest.approx([m["train_loss"] for m in single], rel=1e-6), (mode, warned)
            assert lines == [{k: v for k, v in m.items() if k != "train_loss"} for m in single], (mode, warned)

    def test_the_moving_average_is_updated_at_every_step_on_the_gpu_and_saved_with_the_run(self, learning_run):
        out, result, _ = learning_run("single")
        assert result.returncode == 0, result.stdout + result.stderr
        state = load_on_cpu(out / "checkpoint.pth")
        average = {k.removeprefix("module."): v for k, v in state["ema"].items() if k != "n_averaged"}
        steps = sum(m["train_images"] for m in metrics(out)) // LEARNING_BATCH
        assert int(state["ema"]["n_averaged"]) == steps  # one update a step, none skipped
        assert average.keys() == state["model"].keys()  # the weights and the BatchNorm statistics
        floats = [k for k, t in average.items() if t.is_floating_point()]
        assert all(average[k].dtype == torch.float32 and torch.isfinite(average[k]).all() for k in floats)
        assert any(not torch.equal(average[k], state["model"][k]) for k in floats)  # an average, not a copy

    def test_two_ranks_share_one_gpu_over_gloo_and_run_the_multi_rank_cuda_paths(self, two_ranks_on_one_gpu):
        out, outputs, records = two_ranks_on_one_gpu
        assert sum("2 process(es) on cuda, backend gloo" in output for output in outputs) == 1  # rank 0 alone prints
        [epoch_0] = metrics(out)  # the injected failure stopped the run at the start of epoch 1
        assert epoch_0["world_size"] == 2 and "peak_gpu_mib" in epoch_0 and math.isfinite(epoch_0["train_loss"])

        ddp = probe_records(records, "ddp")
        assert sorted(r["rank"] for r in ddp) == [0, 1]
        for r in ddp:  # both ranks on the one GPU, every BatchNorm2d converted to SyncBatchNorm2d
            assert r["device"] == "cuda:0" and r["world_size"] == 2 and r["backend"] == "gloo"
            assert r["sync_bn"] > 0 and r["batch_norm"] == 0
        synced = probe_records(records, "batch_stats_gathered")
        # SyncBatchNorm2d gathers the statistics of both ranks' batches, on the GPU, over gloo
        assert sorted(r["rank"] for r in synced) == [0, 1]
        assert all(r["device"] == "cuda:0" and r["world_size"] == 2 for r in synced)

    def test_a_checkpoint_of_two_ddp_ranks_resumes_in_one_process_on_the_gpu(
        self, tiny_data, two_ranks_on_one_gpu, tmp_path
    ):
        stopped, outputs, _ = two_ranks_on_one_gpu
        assert any("injected failure on rank 0 at epoch 1" in output for output in outputs), outputs
        out = copy_run(stopped, tmp_path)
        assert load_on_cpu(out / "checkpoint.pth")["world_size"] == 2
        result = resume(tiny_data, out / "checkpoint.pth", "--device", "cuda", "--model-ema")
        # the run's --batch-size 8 and --lr 0.001 were given for 2 processes: one takes both shares
        assert "Resuming on 1 process(es) a run of 2: 16 images and --lr 0.002 per process" in result.stdout
        lines = metrics(out)
        assert [(m["epoch"], m["world_size"]) for m in lines] == [(0, 2), (1, 1)]
        for m in lines:
            assert "peak_gpu_mib" in m and math.isfinite(m["train_loss"]) and 0.0 <= m["ema_val_acc"] <= 1.0
        assert lines[1]["train_images"] == lines[0]["train_images"]  # the same global batches, one process now
        state = load_on_cpu(out / "checkpoint.pth")
        assert state["epoch"] == 1 and state["world_size"] == 1
        # the average went on from the two ranks' steps: one update per global batch of 16, in both epochs
        assert int(state["ema"]["n_averaged"]) == sum(m["train_images"] for m in lines) // 16
        assert_saved_weights_load_on_the_cpu(out)

    @needs_two_gpus
    @pytest.mark.parametrize("mode", TWO_RANKS)
    def test_two_ranks_on_two_gpus_train_over_nccl_and_gather_batch_statistics(self, tiny_data, tmp_path, mode):
        script, flags, launcher = TWO_RANKS[mode]
        env, records = probe_env(tmp_path)
        out = tmp_path / "run"
        result = run_script(
            script, *TWO_EPOCHS, "--data-path", tiny_data, "--output-dir", out, "--device", "cuda", *flags,
            launcher=launcher, env=env | visible_gpus(2),
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "2 process(es) on cuda, backend nccl" in result.stdout
        assert_trained(out, world_size=2)
        ddp = sorted(probe_records(records, "ddp"), key=lambda r: r["rank"])
        assert [(r["rank"], r["device"], r["backend"], r["world_size"]) for r in ddp] == [
            (0, "cuda:0", "nccl", 2), (1, "cuda:1", "nccl", 2)
        ]  # fmt: skip
        assert all(r["sync_bn"] > 0 and r["batch_norm"] == 0 for r in ddp)
        synced = sorted(probe_records(records, "batch_stats_gathered"), key=lambda r: r["rank"])
        assert [(r["rank"], r["device"], r["world_size"]) for r in synced] == [(0, "cuda:0", 2), (1, "cuda:1", 2)]

    @needs_two_gpus
    def test_device_cuda_1_resumes_a_checkpoint_saved_on_gpu_0_and_leaves_gpu_0_alone(self, tiny_data, tmp_path):
        out = stopped_after_epoch_0(tiny_data, tmp_path / "run", "--device", "cuda:0", env=visible_gpus(2))
        env, records = probe_env(tmp_path)
        result = resume(tiny_data, out / "checkpoint.pth", "--device", "cuda:1", env=env | visible_gpus(2))
        assert "1 process(es) on cuda" in result.stdout
        assert_trained(out)
        [memory] = probe_records(records, "gpu_memory")
        # nothing allocated on GPU 0, nor a CUDA context made there (a few hundred MiB of another job's GPU)
        assert memory["peak_bytes"][0] == 0 and memory["peak_bytes"][1] > 0, memory
        assert memory["contexts"] in (None, [False, True]), memory


# ---------------------------------------------------------------------------------------------------- then the rest


# ---------------------------------------------------------------------------------------------------------- precision


@pytest.fixture(scope="module")
def bf16_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "run"
    return out, train_single(tiny_data, out, "--device", "cuda", "--amp", "bf16", "--channels-last")


def test_bf16_channels_last_trains_two_epochs_on_the_gpu(bf16_run):
    out, result = bf16_run
    line = precision_line(result.stdout)
    assert "bfloat16 autocast (--amp bf16)" in line and "memory layout channels_last (--channels-last)" in line
    assert "1 process(es) on cuda" in result.stdout
    assert_trained(out)


@pytest.fixture(scope="module")
def stopped_fp16_gpu_run(tiny_data, tmp_path_factory):
    """fp16 with its gradient scaler, channels_last asked for, on the GPU; stopped after epoch 0."""
    out = tmp_path_factory.mktemp("fp16_stopped") / "run"
    return stopped_after_epoch_0(tiny_data, out, "--device", "cuda", "--amp", "fp16", "--channels-last")


def test_fp16_with_its_gradient_scaler_resumes_on_the_gpu_and_ends_after_two_epochs(
    tiny_data, stopped_fp16_gpu_run, tmp_path
):
    out = copy_run(stopped_fp16_gpu_run, tmp_path)
    scale = load_on_cpu(out / "checkpoint.pth")["scaler"]["scale"]
    assert math.isfinite(scale) and scale > 0  # a live GradScaler's state (a disabled one saves {})
    result = resume(tiny_data, out / "checkpoint.pth", "--device", "cuda", "--amp", "fp16", "--channels-last")
    line = precision_line(result.stdout)
    assert "float16 autocast with gradient scaling (--amp fp16)" in line and "channels_last (--channels-last)" in line
    assert_trained(out)
    assert math.isfinite(load_on_cpu(out / "checkpoint.pth")["scaler"]["scale"])


# ------------------------------------------------------------------------------------- checkpoints between devices


def test_a_checkpoint_saved_on_the_gpu_resumes_on_a_machine_without_one(tiny_data, stopped_fp16_gpu_run, tmp_path):
    out = copy_run(stopped_fp16_gpu_run, tmp_path)
    # The precision may change on resume (a speed flag, not the recipe): fp16 on a CPU would be 20x slower.
    result = resume(tiny_data, out / "checkpoint.pth", "--device", "cpu", "--amp", "off", env=HIDE_GPUS)
    assert "on cpu" in result.stdout
    assert_trained(out, gpu_epochs=[0])  # epoch 0 on the GPU, epoch 1 on the CPU


def test_a_checkpoint_saved_on_the_cpu_resumes_on_the_gpu(tiny_data, tmp_path):
    out = stopped_after_epoch_0(tiny_data, tmp_path / "run", "--device", "cpu", "--amp", "off", env=HIDE_GPUS)
    result = resume(tiny_data, out / "checkpoint.pth", "--device", "cuda", "--amp", "bf16")
    assert "1 process(es) on cuda" in result.stdout
    assert_trained(out, gpu_epochs=[1])


def test_predict_on_a_machine_without_a_gpu_reads_a_checkpoint_saved_on_the_gpu(tiny_data, bf16_run):
    image = next((tiny_data / "daisy").glob("*.jpg"))
    result = run_script(
        "predict.py", image, "--weights", bf16_run[0] / "checkpoint.pth", "--device", "cpu", "--workers", "0",
        env=HIDE_GPUS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"{image}: ") and len(line.split(", ")) == 3  # the top 3 classes


def test_weights_saved_on_the_gpu_load_as_the_readme_shows_where_there_is_no_gpu(bf16_run):
    code = (
        "import sys, torch; from torchvision.models import resnet34; "
        "resnet34(num_classes=5).load_state_dict(torch.load(sys.argv[1], weights_only=True))"
    )
    weights = bf16_run[0] / "weights" / "best.pth"
    result = subprocess.run(
        [sys.executable, "-c", code, str(weights)],
        env={**os.environ, **HIDE_GPUS},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------- predict and evaluate


def test_predict_on_the_gpu_prints_one_line_per_image(tiny_data, bf16_run):
    images = sorted(str(path) for path in tiny_data.rglob("*.jpg"))
    result = run_script(
        "predict.py", tiny_data, "--weights", bf16_run[0] / "weights" / "best.pth", "--device", "cuda",
        "--workers", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert sorted(line.rsplit(": ", 1)[0] for line in lines) == images  # one line per image, each image once
    for line in lines:
        ranked = [item.rsplit(" ", 1) for item in line.rsplit(": ", 1)[1].split(", ")]
        probabilities = [float(p) for _, p in ranked]
        assert len(ranked) == 3 and probabilities == sorted(probabilities, reverse=True)
        assert all(0.0 <= p <= 1.0 for p in probabilities) and sum(probabilities) <= 1.0 + 2e-3  # 3 decimals each


def test_evaluate_on_the_gpu_writes_eval_json_for_the_runs_validation_images(bf16_run, tmp_path):
    out = bf16_run[0]
    result = run_script(
        "evaluate.py", "--weights", out / "weights" / "last.pth", "--device", "cuda", "--workers", "0",
        "--output-dir", tmp_path / "eval",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    logged = metrics(out)[1]
    assert report["total"] == logged["val_total"]  # the run's own split
    assert [report["per_class"][name]["support"] for name in report["classes"]] == logged["val_per_class_total"]
    assert 0.0 <= report["accuracy"] <= 1.0
    # The same weights, batches and precision as the run's validation; a GPU kernel may round a near-tie otherwise.
    assert abs(report["correct"] - logged["val_correct"]) <= 1


# ------------------------------------------------------------------------------------------------------------ DDP


def test_one_torchrun_cannot_put_two_processes_on_one_gpu(tiny_data, tmp_path):
    """Each process takes the GPU of its LOCAL_RANK: with one GPU visible, rank 1 asks for cuda:1 and stops."""
    result = run_script(
        "train_multi_gpu_using_launch.py", *TWO_EPOCHS, "--data-path", tiny_data, "--output-dir", tmp_path / "run",
        "--device", "cuda", "--dist-backend", "gloo", launcher=torchrun(2), env=visible_gpus(1), timeout=180,
    )  # fmt: skip
    assert result.returncode != 0
    assert "error: GPU 1 asked for but only 1 visible" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------- one process, more


def test_data_parallel_with_one_gpu_trains_the_plain_model_fed_by_a_pinned_loader(tiny_data, tmp_path):
    out = tmp_path / "run"
    env, records = probe_env(tmp_path)
    flags = ("--device", "cuda", "--data-parallel", "--batches", "loader", "--workers", "1")
    result = train_single(tiny_data, out, *flags, env=env | visible_gpus(1))
    loaders = probe_records(records, "loader")
    assert len(loaders) == 2 and all(loader["pin_memory"] and loader["workers"] == 1 for loader in loaders)
    assert "--data-parallel: only one device (cuda:0) to run on, so the model trains as it is" in result.stdout
    assert_trained(out)


# Last: the slowest test (a compilation of a minute or more), and the one that needs most of the machine (Triton
# compiles with the machine's C compiler); with -x the others have run first.
def test_compile_trains_two_epochs_on_the_gpu_and_saves_plain_weights(tiny_data, tmp_path):
    out = tmp_path / "run"
    amp = "bf16" if bf16_is_native() else "off"
    result = train_single(tiny_data, out, "--device", "cuda", "--compile", "--amp", amp, "--channels-last", timeout=600)
    assert f"(--amp {amp}); memory layout channels_last (--channels-last)" in precision_line(result.stdout)
    assert_trained(out)


def test_compile_under_ddp_two_ranks_sharing_one_gpu_over_gloo_trains_and_saves_plain_weights(tiny_data, tmp_path):
    """--compile in the DDP script: DDP's wrapper compiled around SyncBatchNorm2d (torch.compile splits the graph at
    DDP's gradient buckets, and breaks it where it cannot trace); two ranks, each LOCAL_RANK 0 of a "node", share the
    GPU over gloo (see the module's docstring). The graph breaks are counted in each rank's log (TORCH_LOGS) and
    printed for the record."""
    out, logs = tmp_path / "run", [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    port, job_id = find_free_port(), f"gpu-{uuid.uuid4().hex[:8]}"
    amp = "bf16" if bf16_is_native() else "off"
    env = visible_gpus(1) | {"TORCH_LOGS": "graph_breaks"}

    def start(rank, log):
        return start_node(rank, port, job_id, tiny_data, out, env, log, "--compile", "--amp", amp, "--channels-last")

    outputs = run_nodes(start, logs, 540)
    assert_trained(out, world_size=2)
    breaks = [output.count("Graph break") for output in outputs]
    print(f"graph breaks logged by rank 0 and rank 1: {breaks}")
    assert breaks[0] == breaks[1]  # the two ranks trace the same model alike


# ---------------------------------------------------------------------------------------- batches made on the GPU


def test_batches_made_on_the_gpu_are_the_cpus_to_rounding_and_take_the_same_memory_every_epoch(tiny_data):
    """dataset/on_device.py on CUDA (float16 resampling) against the same code on the CPU (float32), epoch after
    epoch: the same labels, images within a level of 255 of each other, in channels_last; and after the first
    epoch, the GPU's allocated memory is the same at every epoch's end (nothing kept from step to step)."""
    split, config = read_split_data(tiny_data), Config(img_size=32, batch_size=8)
    train_set, _ = datasets(planned(split, config), config)
    made = {
        device: TrainingBatches(train_set, shuffled_batches(train_set, 8, 0), device, torch.channels_last)
        for device in ("cuda", "cpu")
    }
    level = 1 / (255 * min(IMAGENET_STD))  # one level of 255, normalised
    allocated = []
    for epoch in range(3):
        for batches in made.values():
            batches.batch_sampler.set_epoch(epoch)
        for (gpu, gpu_labels), (cpu, cpu_labels) in zip(made["cuda"], made["cpu"], strict=True):
            assert gpu.is_cuda and gpu.dtype == torch.float32 and gpu.is_contiguous(memory_format=torch.channels_last)
            cpu = Choice(channels_last=True).batch_to(cpu, "cpu")  # the CPU's are the loader's 8-bit bytes
            assert (gpu.cpu() - cpu).abs().max() <= level and torch.equal(gpu_labels, cpu_labels)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[2], allocated


def test_batches_streamed_to_the_gpu_are_the_held_ones_bitwise_epoch_after_epoch(tiny_data):
    """The same batches gathered from the store on the host and streamed (pinned, copied on a stream of their own,
    waited for by the step's stream) as from the images held on the GPU: bitwise (the host's waits:
    tests/test_host_syncs.py, on this GPU too)."""
    split, config = read_split_data(tiny_data), Config(img_size=32, batch_size=8)
    train_set, _ = datasets(planned(split, config), config)
    made = [TrainingBatches(train_set, shuffled_batches(train_set, 8, 0), "cuda", torch.channels_last, streamed)
            for streamed in (False, True)]  # fmt: skip
    for epoch in range(2):
        for batches in made:
            batches.batch_sampler.set_epoch(epoch)
        pairs = [(held.clone(), streamed.clone()) for (held, _), (streamed, _) in zip(*made, strict=True)]
        assert len(pairs) == len(made[0]) and all(torch.equal(held, streamed) for held, streamed in pairs)
