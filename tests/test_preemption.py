"""Stopping at a step (multi_train_utils/stop_and_resume.py): a stop signal (SIGTERM, SIGUSR1) ends a run at a
training step every rank agrees on, saved with a second signal arriving while it is written, and the resumed run
ends bitwise as the uninterrupted one: in one process, under torchrun and under the spawn script."""

import signal
import subprocess
import sys

import pytest
import torch
from conftest import (
    DDP_FLAGS,
    REFERENCE_FLAGS,
    ROOT,
    fault_env,
    final_weights,
    metrics_without_timings,
    processes_with,
    run_script,
    torchrun,
)

from multi_train_utils.checkpoint import load_checkpoint

SCRIPTS = {
    "one process": ("train_single_gpu.py", (), ()),
    "torchrun": ("train_multi_gpu_using_launch.py", torchrun(2), ()),
    "spawn": ("train_multi_gpu_using_spawn.py", (), ("--world-size", "2")),
}


def stop_and_resume(script: str, flags: tuple, out, fault: str) -> tuple:
    """Run `script` with the stop fault (tests/fault_injection), then the same command with --auto-resume: (the
    stopped run, its checkpoint, the resumed run)."""
    name, launcher, script_flags = SCRIPTS[script]
    flags = (*flags, *script_flags, "--output-dir", out)
    env = fault_env(fault)
    stopped = run_script(name, *flags, launcher=launcher, env=env, timeout=240)
    assert not processes_with(env["RUN_MARKER"])  # every rank and loader exited
    state = load_checkpoint(out / "checkpoint.pth")  # whole, though a second signal came while it was written
    assert not list(out.glob(".*.tmp"))
    resumed = run_script(name, *flags, "--auto-resume", launcher=launcher, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    return stopped, state, resumed


def test_sigusr1_stops_one_process_at_a_step_and_the_resumed_run_ends_bitwise_as_the_uninterrupted_one(
    tiny_data, tmp_path, reference_run
):
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS)  # 4 epochs of 6 steps, as the reference run
    stopped, state, resumed = stop_and_resume("one process", flags, tmp_path / "run", "stop:1:2:USR1")
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr
    # the signal comes as batch 2 loads; train_one_epoch reads a step's sums during the next step: 3 is the last
    assert "stopped by SIGUSR1 at epoch 1, step 4: saved in" in stopped.stdout
    assert state["epoch"] == 0 and state["midway"]["step"] == 4
    assert "epoch 1, step 4 of 4" in resumed.stdout
    expected, weights = final_weights(reference_run), final_weights(tmp_path / "run")
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert metrics_without_timings(tmp_path / "run") == metrics_without_timings(reference_run)


@pytest.mark.parametrize("script, uninterrupted", [("torchrun", "torchrun_run"), ("spawn", "spawn_run")])
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_and_the_resumed_run_ends_bitwise(
    tiny_data, tmp_path, script, uninterrupted, request
):
    # Rank 0 signals its launcher, which passes SIGTERM on to both ranks: they agree on a step and rank 0 saves it.
    flags = ("--data-path", tiny_data, *DDP_FLAGS)  # 2 epochs of 3 steps, as the uninterrupted run
    stopped, state, resumed = stop_and_resume(script, flags, tmp_path / "run", "stop:1:1:TERM")
    assert stopped.returncode != 0
    assert "stopped by SIGTERM at epoch 1, step" in stopped.stdout + stopped.stderr
    assert state["epoch"] == 0 and 2 <= state["midway"]["step"] <= 3  # the signal reaches the ranks within a step
    if script == "spawn":
        assert stopped.returncode == 128 + signal.SIGTERM and "error:" not in stopped.stderr
    reference = request.getfixturevalue(uninterrupted)[1]
    expected, weights = final_weights(reference), final_weights(tmp_path / "run")
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert metrics_without_timings(tmp_path / "run") == metrics_without_timings(reference)


def test_a_process_whose_loader_workers_were_never_shut_down_exits_at_once(tmp_path):
    # A stop signal ends a run with its persistent loader workers still running (the loader is never shut down).
    # They ignore SIGTERM (ignore_stop_signals), which is how multiprocessing ends them at exit: without
    # stop_and_resume.end_loader_processes the process would wait for them for ever (it did on torch 2.11).
    program = (
        "from torch.utils.data import DataLoader\n"
        "from multi_train_utils.stop_and_resume import ignore_stop_signals\n"
        "loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,\n"
        "                    worker_init_fn=ignore_stop_signals)\n"
        "batches = iter(loader)\n"
        "next(batches)  # the workers run, and this reference keeps them until the interpreter ends\n"
    )
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
