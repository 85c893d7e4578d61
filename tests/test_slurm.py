"""SLURM: processes that srun starts (SLURM_* variables, no RANK or WORLD_SIZE) join one group, and
examples/slurm_train.sbatch starts one torchrun per node that meet on the first node.

No SLURM is needed: the tests set the variables srun would set, and stand in for srun and scontrol.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, ROOT, script_command

from multi_train_utils.spawn_utils import find_free_port

SBATCH = ROOT / "examples" / "slurm_train.sbatch"
TIMEOUT = 120

# A process as srun would start it: init_distributed_mode on the flags the launch script has, then an all-reduce.
JOIN_AND_SUM = """
import torch
import torch.distributed as dist
from multi_train_utils.distributed_utils import cleanup, init_distributed_mode

process = init_distributed_mode("cpu", timeout_s=60)
total = torch.tensor([process.rank + 1])
dist.all_reduce(total)
print(process.rank, process.world_size, process.local_rank, process.local_world_size, dist.get_backend(), int(total))
cleanup()
"""


def srun_environment(rank: int, ntasks: int, port: int) -> dict:
    """The environment of task `rank` of `ntasks` on one node, as srun sets it, plus the master address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    return {
        **env,
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS_PER_NODE": str(ntasks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }


def srun(command: list[str], ntasks: int = 2) -> list[tuple[int, str]]:
    """Run `command` as `ntasks` SLURM tasks on this machine, all at once; each task's (exit status, output)."""
    port = find_free_port()
    deadline = time.monotonic() + TIMEOUT
    tasks = [
        subprocess.Popen(command, cwd=ROOT, env=srun_environment(rank, ntasks, port), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for rank in range(ntasks)
    ]  # fmt: skip
    try:
        outputs = [task.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for task in tasks]
        return [(task.returncode, output) for task, output in zip(tasks, outputs, strict=True)]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
                task.wait()


def test_init_distributed_mode_builds_a_group_from_slurm_variables_alone():
    results = srun([sys.executable, "-c", JOIN_AND_SUM])
    outputs = [output for _, output in results]
    for rank, (_, output) in enumerate(results):
        assert output.split() == [str(rank), "2", str(rank), "2", "gloo", "3"], outputs


def test_the_launch_script_trains_under_slurm_variables(tiny_data, tmp_path):
    out = tmp_path / "run"
    command = script_command(
        "train_multi_gpu_using_launch.py", "--data-path", tiny_data, "--output-dir", out, "--epochs", "1", *FAST,
        "--device", "cpu",
    )  # fmt: skip
    results = srun(command)
    assert [status for status, _ in results] == [0, 0], results
    assert "2 process(es) on cpu, backend gloo" in results[0][1]  # rank 0 prints...
    assert "process(es)" not in results[1][1]  # ...alone
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["epoch"], m["world_size"]) for m in metrics] == [(0, 2)]
    assert (out / "weights" / "last.pth").is_file()


def test_the_sbatch_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def fake_slurm(tmp_path):
    """srun and scontrol stand-ins on PATH: srun writes the command it was asked to run, one argument a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "srun_args"}\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu07\\ngpu08\\n"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir, tmp_path / "srun_args"


def test_the_sbatch_script_starts_one_torchrun_per_node_meeting_on_the_first_node(fake_slurm):
    bin_dir, srun_args = fake_slurm
    job = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "32"}  # fmt: skip
    result = subprocess.run(
        ["bash", SBATCH, "--data-path", "/shared/flowers", "--epochs", "5"],
        cwd=ROOT,
        env={**os.environ, **job, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    args = srun_args.read_text().splitlines()
    launcher = args.index("torch.distributed.run")
    script = args.index("train_multi_gpu_using_launch.py")
    assert args[launcher - 1] == "-m" and launcher < script
    assert set(args[launcher + 1 : script]) >= {
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu07:{20000 + 4321}",
        "--rdzv-id=4321",
        "--log-dir=logs/slurm-4321",  # each training process's stdout.log, stderr.log and error.json...
        "--tee=3",  # ...and every line in the job's log too
    }
    assert "--label" in args[: launcher - 1]  # srun: each line of the job's log names its machine
    after = args[script + 1 :]
    assert "--auto-resume" in after and after[after.index("--output-dir") + 1] == "runs/slurm-4321"
    assert after[-4:] == ["--data-path", "/shared/flowers", "--epochs", "5"]


def test_near_the_time_limit_the_sbatch_script_stops_the_training_at_a_step_before_it_requeues(tmp_path):
    # srun and scontrol stand-ins that write what happens to them into one log, in order
    bin_dir, log = tmp_path / "bin", tmp_path / "events"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\ntrap \'echo "srun: SIGTERM" >> {log}; exit 143\' TERM\necho "srun: started" >> {log}\n'
        "while true; do sleep 0.1; done\n"
    )
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu07\\n" || echo "scontrol: $*" >> {log}\n'
    )
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    job = {"SLURM_JOB_ID": "4321", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu07"}
    env = {**os.environ, **job, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    sbatch = subprocess.Popen(["bash", SBATCH], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "srun: started" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        sbatch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends
        output = sbatch.communicate(timeout=30)[0]
    finally:
        sbatch.kill()
    assert "stopping at a step" in output
    assert log.read_text().splitlines() == ["srun: started", "srun: SIGTERM", "scontrol: requeue 4321"]
