"""Stopping at a step (multi_train_utils/stop_and_resume.py): a stop signal (SIGTERM, SIGUSR1) ends a run at a
training step every rank agrees on, saved with a second signal arriving while it is written, and the resumed run
ends bitwise as the uninterrupted one: in one process, under torchrun and under the spawn script."""

import re
import signal
import subprocess
import sys

import conftest as runs
import pytest
import torch
from conftest import DDP_FLAGS, REFERENCE_FLAGS, ROOT

from multi_train_utils.checkpoint import load_checkpoint

SCRIPTS = {
    "one process": ("train_single_gpu.py", (), ()),
    "torchrun": ("train_multi_gpu_using_launch.py", runs.torchrun(2), ()),
    "spawn": ("train_multi_gpu_using_spawn.py", (), ("--world-size", "2")),
}


def stop_and_resume(script: str, flags: tuple, out, fault: str) -> tuple:
    """Run `script` with the stop fault (tests/fault_injection), then the same command with --auto-resume: (the
    stopped run, its checkpoint, the resumed run)."""
    name, launcher, script_flags = SCRIPTS[script]
    env = runs.fault_env(fault)
    stopped = runs.run_script(name, *flags, *script_flags, "--output-dir", out, launcher=launcher, env=env, timeout=240)
    assert not runs.processes_with(env["RUN_MARKER"])  # every rank and loader exited
    return resume(script, flags, out, stopped)


def resume(script: str, flags: tuple, out, stopped) -> tuple:
    """The run in `out` that `stopped` left, continued by the same command with --auto-resume: (the stopped run,
    its checkpoint, the resumed run)."""
    name, launcher, script_flags = SCRIPTS[script]
    state = load_checkpoint(out / "checkpoint.pth")  # whole, though a second signal came while it was written
    assert not list(out.glob(".*.tmp"))
    command = (name, *flags, *script_flags, "--output-dir", out, "--auto-resume")
    # one process resumes in this one (the stop needed a process of its own; its resumption does not)
    resumed = runs.run_here(*command) if script == "one process" else runs.run_script(*command, launcher=launcher)
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
    expected, weights = runs.final_weights(reference_run), runs.final_weights(tmp_path / "run")
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert runs.metrics_without_timings(tmp_path / "run") == runs.metrics_without_timings(reference_run)


def fault_events(output: str) -> list[str]:
    """The injected faults' lines (tests/fault_injection: "fault: ...") and the stop's ("stopped by"), in order, from a
    run's output, where they may share a line with a progress bar."""
    return re.findall(r"fault: (?:writing \S+|wrote \S+|stop signal sent)|stopped by", output)


def test_a_stop_during_an_epochs_write_waits_for_it_and_resumes_bitwise(tiny_data, tmp_path, reference_run):
    """Epoch 0's files are written in the background, slowly (2 s a file), while epoch 1 trains; the stop signal
    comes meanwhile. The stop's checkpoint is saved after the write has ended, so it is not overwritten by epoch 0's,
    and the resumed run ends bitwise as the uninterrupted one."""
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS)
    stopped, state, resumed = stop_and_resume("one process", flags, tmp_path / "run", "slowsave:2,stop:1:2:USR1")
    assert stopped.returncode == 128 + signal.SIGUSR1, stopped.stderr
    events = fault_events(stopped.stdout)
    sent, saved = events.index("fault: stop signal sent"), events.index("stopped by")
    assert sent < events.index("fault: wrote checkpoint.pth")  # epoch 0's files not all written at the signal
    assert events[saved - 1] == "fault: wrote checkpoint.pth"  # and all of them before the stop's checkpoint
    assert state["epoch"] == 0 and state["midway"]["step"] == 4  # the stop's, not epoch 0's written after it
    expected, weights = runs.final_weights(reference_run), runs.final_weights(tmp_path / "run")
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert runs.metrics_without_timings(tmp_path / "run") == runs.metrics_without_timings(reference_run)


def test_kill_9_during_an_epochs_write_leaves_the_last_files_whole_and_the_resumed_run_ends_bitwise(
    tiny_data, tmp_path, reference_run
):
    """Epoch 1's files are being written in the background (slowly: 1 s a file) when the process is killed with
    SIGKILL half a second into epoch 2, as the OOM killer would: the files on disk are whole (epoch 0's, or those of
    epoch 1 written by then); the run resumed from them ends bitwise as the uninterrupted one."""
    out = tmp_path / "run"
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS, "--output-dir", out)
    killed = runs.run_script(
        "train_single_gpu.py", *flags, env=runs.fault_env("slowsave:1,pause:2:0.5,kill:2"), timeout=240
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    events = fault_events(killed.stdout)
    assert events[-1].startswith("fault: writing"), events  # a write in flight at the kill
    state = load_checkpoint(out / "checkpoint.pth")  # whole: epoch 0's, or epoch 1's if it was written in time
    assert state["epoch"] in (0, 1) and torch.load(out / "weights" / "last.pth", weights_only=True)
    resumed = runs.run_here("train_single_gpu.py", *flags, "--auto-resume")
    assert resumed.returncode == 0, resumed.stderr
    expected, weights = runs.final_weights(reference_run), runs.final_weights(out)
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert runs.metrics_without_timings(out) == runs.metrics_without_timings(reference_run)


@pytest.mark.parametrize("script, uninterrupted", [("torchrun", "torchrun_run"), ("spawn", "spawn_run")])
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_and_the_resumed_run_ends_bitwise(
    tiny_data, tmp_path, script, uninterrupted, request
):
    # Rank 0 signals its launcher, which passes SIGTERM on to both ranks: they agree on a step and rank 0 saves it.
    flags = ("--data-path", tiny_data, *DDP_FLAGS)  # 2 epochs of 3 steps, as the uninterrupted run
    if script == "torchrun":  # the suite's torchrun run stopped so (tracked, for test_tracking), resumed untracked
        stopped, _, as_stopped, _ = request.getfixturevalue("stopped_torchrun_run")
        stopped, state, resumed = resume(script, flags, runs.copy_run(as_stopped, tmp_path), stopped)
    else:
        stopped, state, resumed = stop_and_resume(script, flags, tmp_path / "run", "stop:1:1:TERM")
    assert stopped.returncode != 0
    assert "stopped by SIGTERM at epoch 1, step" in stopped.stdout + stopped.stderr
    assert state["epoch"] == 0 and 2 <= state["midway"]["step"] <= 3  # the signal reaches the ranks within a step
    if script == "spawn":
        assert stopped.returncode == 128 + signal.SIGTERM and "error:" not in stopped.stderr
    reference = request.getfixturevalue(uninterrupted)[1]
    expected, weights = runs.final_weights(reference), runs.final_weights(tmp_path / "run")
    assert all(torch.equal(expected[k], weights[k]) for k in expected)
    assert runs.metrics_without_timings(tmp_path / "run") == runs.metrics_without_timings(reference)


def test_a_process_whose_loader_workers_were_never_shut_down_exits_at_once(tmp_path):
    # A stop signal ends a run with its persistent loader workers still running (the loader is never shut down).
    # They ignore SIGTERM (ignore_stop_signals), which is how multiprocessing ends them at exit: without
    # my_dataset.end_loader_processes the process would wait for them for ever (it did on torch 2.11).
    program = (
        "from torch.utils.data import DataLoader\n"
        "from my_dataset import ignore_stop_signals\n"
        "loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,\n"
        "                    worker_init_fn=ignore_stop_signals)\n"
        "batches = iter(loader)\n"
        "next(batches)  # the workers run, and this reference keeps them until the interpreter ends\n"
    )
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
