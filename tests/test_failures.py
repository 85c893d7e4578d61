"""Surviving crashes: full-state resume, elastic restart, failing ranks, signals, non-finite loss."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    REFERENCE_FLAGS,
    ROOT,
    STOPPED_FLAGS,
    assert_user_error,
    copy_run,
    fault_env,
    final_weights,
    metrics_without_timings,
    processes_with,
    run_here,
    run_script,
    script_command,
    torchrun,
)

from multi_train_utils.checkpoint import load_checkpoint


def start(script, *args, launcher=(), env=None) -> subprocess.Popen:
    """Like run_script, but in the background, for tests that kill or signal the run."""
    return subprocess.Popen(
        script_command(script, *args, launcher=launcher),
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(path: Path, epoch: int, process: subprocess.Popen, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if torch.load(path, weights_only=True, mmap=True)["epoch"] >= epoch:
                return
        except (FileNotFoundError, RuntimeError, EOFError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of epoch {epoch} within {timeout} s")


@pytest.mark.guarantee
def test_a_run_killed_after_epoch_2_and_resumed_ends_bitwise_as_an_uninterrupted_run(
    tiny_data, tmp_path, reference_run
):
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS)  # 4 epochs, as the uninterrupted reference run
    out = tmp_path / "killed"
    process = start("train_single_gpu.py", *flags, "--output-dir", out, env=fault_env("slow"))
    try:
        wait_for_checkpoint(out / "checkpoint.pth", epoch=1, process=process)  # epochs 0 and 1 done
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate()
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] in (1, 2)  # the kill left a whole checkpoint
    resumed = run_here("train_single_gpu.py", *flags, "--resume", out / "checkpoint.pth")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from" in resumed.stdout

    expected_weights, weights = final_weights(reference_run), final_weights(out)
    assert all(torch.equal(expected_weights[k], weights[k]) for k in expected_weights)
    assert metrics_without_timings(out) == metrics_without_timings(reference_run)  # every epoch once


def test_a_resume_that_would_change_the_recipe_is_refused_and_leaves_the_run_as_it_was(
    tiny_data, stopped_run, tmp_path, run_main
):
    out = copy_run(stopped_run, tmp_path)  # 2 epochs (STOPPED_FLAGS), stopped after epoch 0
    flags = ("--data-path", tiny_data, *STOPPED_FLAGS)
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 0
    before = {path: path.read_bytes() for path in (out / "checkpoint.pth", out / "metrics.jsonl")}

    # A longer schedule (and another rate) would bend the learning rate of the epochs still to come.
    refused = run_main(
        "train_single_gpu.py", *flags, "--epochs", "3", "--lr", "0.5", "--resume", out / "checkpoint.pth"
    )
    assert_user_error(refused, "--epochs 2 (not 3), --lr 0.001 (not 0.5)")
    assert {path: path.read_bytes() for path in before} == before

    # Speed flags may change: the recipe is the same.
    resumed = run_here(
        "train_single_gpu.py", *flags, "--workers", "1", "--batches", "loader", "--resume", out / "checkpoint.pth"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 1


def test_torchrun_restarts_a_killed_worker_and_the_run_completes_from_its_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    env = fault_env("slow")
    launcher = (*torchrun(2), "--max-restarts", "1")
    flags = ("--data-path", tiny_data, "--epochs", "3", "--device", "cpu", "--output-dir", out, "--auto-resume",
             "--dist-timeout", "60")  # fmt: skip
    process = start("train_multi_gpu_using_launch.py", *flags, *FAST, launcher=launcher, env=env)
    try:
        wait_for_checkpoint(out / "checkpoint.pth", epoch=0, process=process)
        workers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=240)
    finally:
        process.kill()  # a no-op when it has finished; never leave a hung job behind
    assert process.returncode == 0, stderr
    assert "Resuming from" in stdout
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not processes_with(env["RUN_MARKER"])


@pytest.mark.parametrize("mode", ["torchrun", "spawn"])
def test_a_rank_that_raises_ends_the_whole_job_promptly(tiny_data, tmp_path, mode):
    env = fault_env("raise:1:1")  # rank 1 fails at the start of epoch 1, while rank 0 waits for it
    flags = ("--data-path", tiny_data, "--epochs", "3", "--device", "cpu", "--output-dir", tmp_path / "run", *FAST)
    started = time.monotonic()
    if mode == "torchrun":
        result = run_script("train_multi_gpu_using_launch.py", *flags, launcher=torchrun(2), env=env, timeout=120)
    else:
        result = run_script("train_multi_gpu_using_spawn.py", *flags, "--world-size", "2", env=env, timeout=120)
    assert result.returncode != 0
    assert "injected failure on rank 1 at epoch 1" in result.stderr
    assert time.monotonic() - started < 90
    assert not processes_with(env["RUN_MARKER"])
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pth")["epoch"] == 0


def test_a_non_finite_loss_stops_every_rank_with_one_message_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    env = fault_env("nan:1")
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, "--epochs", "3", "--device", "cpu", "--world-size", "2", "--output-dir", out)
    result = run_script("train_multi_gpu_using_spawn.py", *flags, *FAST, env=env, timeout=120)
    assert result.returncode == 2
    assert "error: non-finite loss at epoch 1" in result.stderr and "Traceback" not in result.stderr
    state = load_checkpoint(out / "checkpoint.pth")
    assert state["epoch"] == 0
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
