"""On a CUDA GPU: the scripts end to end, run as a user runs them. Skipped where torch sees no GPU.

    python -m pytest tests/test_gpu.py -m gpu -n 0   # or: bash tools/gpu_run.sh (the GPU benchmark, then these tests)

Every check goes through the scripts' command lines, in fresh interpreters, on the small generated data of the
other tests (tiny_data, 32 px crops, 2 epochs), so the file takes a few minutes. What only a GPU can show: bf16 and
fp16 (with its gradient scaler) on CUDA, channels_last and torch.compile there, checkpoints moving between the GPU
and a machine without one, predict.py and evaluate.py on CUDA, both DDP launchers on nccl with torch's own
SyncBatchNorm, two ranks sharing one GPU so that the multi-rank CUDA paths (SyncBatchNorm's gathers, DDP's gradient
buckets) run at least once, and --data-parallel with one GPU.

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
from conftest import FAST, ROOT, copy_run, fault_env, run_nodes, run_script, script_command, torchrun

from multi_train_utils.spawn_utils import find_free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TWO_EPOCHS = ("--epochs", "2", "--seed", "0", *FAST, "--model", "resnet34")  # the scripts' network, on the GPU
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # a process that sees no GPU: a machine without one, as far as torch can tell

# Written into a folder put first on PYTHONPATH: Python imports it at start-up in every process of a run (torchrun's
# agent, its workers, spawn's workers), and it records what torch's DDP, SyncBatchNorm and DataLoader saw there. It
# wraps torch's public classes only; the scripts are untouched.
PROBE = """
import json
import os

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

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
        sync_bn=sum(k is nn.SyncBatchNorm for k in kinds), batch_norm=sum(k is nn.BatchNorm2d for k in kinds),
    )


_sync_bn_forward = nn.SyncBatchNorm.forward
_seen = []


def _probed_sync_bn_forward(self, input):
    if self.training and not _seen and dist.is_initialized():
        _seen.append(True)
        _record(
            event="sync_bn_forward", rank=dist.get_rank(), world_size=dist.get_world_size(),
            backend=dist.get_backend(), device=str(input.device),
        )
    return _sync_bn_forward(self, input)


_loader_init = DataLoader.__init__


def _probed_loader_init(self, *args, **kwargs):
    _loader_init(self, *args, **kwargs)
    _record(event="loader", pin_memory=self.pin_memory, workers=self.num_workers)


nn.parallel.DistributedDataParallel.__init__ = _probed_ddp_init
nn.SyncBatchNorm.forward = _probed_sync_bn_forward
DataLoader.__init__ = _probed_loader_init
"""


def one_visible_gpu() -> dict:
    """Environment that shows a process only the first GPU this one sees (a one-GPU machine)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return {"CUDA_VISIBLE_DEVICES": first}


def bf16_is_native() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 0)


def precision_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("Precision:")]
    assert len(lines) == 1, stdout
    return lines[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_on_cpu(path: Path):
    return torch.load(path, weights_only=True, map_location="cpu")


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
    weights = load_on_cpu(out / "weights" / "last.pth")
    assert weights and all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
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
    code, records = tmp_path / "probe", tmp_path / "probe_records"
    code.mkdir()
    records.mkdir()
    (code / "sitecustomize.py").write_text(PROBE)
    return {"PYTHONPATH": str(code), "GPU_PROBE_DIR": str(records)}, records


def probe_records(records: Path, event: str) -> list[dict]:
    lines = [json.loads(line) for log in sorted(records.glob("*.jsonl")) for line in log.read_text().splitlines()]
    return [line for line in lines if line["event"] == event]


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


ONE_PROCESS = {
    "torchrun": ("train_multi_gpu_using_launch.py", (), torchrun(1)),
    "spawn": ("train_multi_gpu_using_spawn.py", ("--world-size", "1"), ()),
}


@pytest.mark.parametrize("mode", ONE_PROCESS)
def test_one_process_of_each_launch_mode_trains_on_nccl_with_sync_batchnorm(tiny_data, tmp_path, mode):
    script, flags, launcher = ONE_PROCESS[mode]
    env, records = probe_env(tmp_path)
    out = tmp_path / "run"
    result = run_script(
        script, *TWO_EPOCHS, "--data-path", tiny_data, "--output-dir", out, "--device", "cuda", *flags,
        launcher=launcher, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 process(es) on cuda, backend nccl" in result.stdout
    assert_trained(out)
    [ddp] = probe_records(records, "ddp")
    assert ddp["backend"] == "nccl" and ddp["device"] == "cuda:0" and ddp["world_size"] == 1
    assert ddp["sync_bn"] > 0 and ddp["batch_norm"] == 0  # every BatchNorm converted to torch's SyncBatchNorm
    loaders = probe_records(records, "loader")
    assert len(loaders) == 2 and all(loader["pin_memory"] for loader in loaders)  # training and validation, pinned


def test_one_torchrun_cannot_put_two_processes_on_one_gpu(tiny_data, tmp_path):
    """Each process takes the GPU of its LOCAL_RANK: with one GPU visible, rank 1 asks for cuda:1 and stops."""
    result = run_script(
        "train_multi_gpu_using_launch.py", *TWO_EPOCHS, "--data-path", tiny_data, "--output-dir", tmp_path / "run",
        "--device", "cuda", "--dist-backend", "gloo", launcher=torchrun(2), env=one_visible_gpu(), timeout=180,
    )  # fmt: skip
    assert result.returncode != 0
    assert "error: GPU 1 asked for but only 1 visible" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def start_node(node_rank: int, port: int, job_id: str, data, out, env: dict, log) -> subprocess.Popen:
    """One torchrun agent of a 2-node job, one process, as README's multi-machine command starts it."""
    launcher = (
        "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job_id}",
    )  # fmt: skip
    command = script_command(
        "train_multi_gpu_using_launch.py", *TWO_EPOCHS, "--data-path", data, "--output-dir", out,
        "--device", "cuda", "--dist-backend", "gloo", launcher=launcher,
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


def test_two_ranks_share_one_gpu_over_gloo_and_run_the_multi_rank_cuda_paths(tiny_data, tmp_path):
    """Two torchrun agents of one process each (two "nodes" on this machine): both processes are LOCAL_RANK 0 and
    take cuda:0 of the same GPU; gloo carries their collectives (nccl refuses two ranks on one device)."""
    env, records = probe_env(tmp_path)
    env.update(one_visible_gpu())
    out, logs = tmp_path / "run", [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    port, job_id = find_free_port(), f"gpu-{uuid.uuid4().hex[:8]}"
    outputs = run_nodes(lambda rank, log: start_node(rank, port, job_id, tiny_data, out, env, log), logs, 300)
    assert sum("2 process(es) on cuda, backend gloo" in output for output in outputs) == 1  # rank 0 alone prints
    assert_trained(out, world_size=2)

    ddp = probe_records(records, "ddp")
    assert sorted(r["rank"] for r in ddp) == [0, 1]
    for r in ddp:  # both ranks on the one GPU, every BatchNorm converted to torch's SyncBatchNorm
        assert r["device"] == "cuda:0" and r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["sync_bn"] > 0 and r["batch_norm"] == 0
    synced = probe_records(records, "sync_bn_forward")
    # torch's SyncBatchNorm gathers statistics over the ranks when training on CUDA with world size > 1
    assert sorted(r["rank"] for r in synced) == [0, 1]
    assert all(r["device"] == "cuda:0" and r["world_size"] == 2 for r in synced)


# ---------------------------------------------------------------------------------------------- one process, more


def test_data_parallel_with_one_gpu_trains_the_plain_model(tiny_data, tmp_path):
    out = tmp_path / "run"
    result = train_single(tiny_data, out, "--device", "cuda", "--data-parallel", env=one_visible_gpu())
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
