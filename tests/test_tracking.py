"""Experiment tracking (run/tracking.py): one tracked run through a stop by signal under torchrun, a failure, a
resume on another number of processes and the end, each epoch logged once, read back through MLflow's own client
as a user's tools would; a tracker that fails costs one warning and nothing else (one that cannot be reached at
the start: tests/test_needs.py); a damaged record of the tracked run, whatever the damage, is tracked anew."""

import contextlib
import importlib
import io
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DDP_FLAGS, REFERENCE_FLAGS, run_here
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_files_read_back import JSON, damaged, reshaped

from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.spawn_utils import find_free_port
from run import run_log
from run.config import Config
from run.tracking import EXPERIMENT, MLFLOW_SETTINGS, TRACKED_RUN_NAME, Tracking, read_tracked_run
from utils import OutputError, UserError


@contextlib.contextmanager
def mlflow_settings():
    """MLflow's settings as a tracked run sets them in its process (MLFLOW_SETTINGS), set here first, so that a
    script's main run in this process leaves the environment as it was; and no MLFLOW_TRACKING_URI of the user's."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in MLFLOW_SETTINGS.items():
            patch.setenv(name, value)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        yield


@pytest.fixture(autouse=True)
def settings_of_this_test():
    with mlflow_settings():
        yield


def tracked_runs(uri: str) -> list:
    """Every run the tracker at `uri` holds, in any experiment, through MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(point.step, point.value) for point in MlflowClient(uri).get_metric_history(run_id, key)]


def full_disk(output_dir, epoch, *args, **options):
    """run_log's save_epoch on a full disk: the epoch's metrics.jsonl line is written, its checkpoint is not."""
    raise OutputError(f"cannot write {output_dir / 'weights' / 'last.pth'}: No space left on device")


def seen(uri: str) -> SimpleNamespace:
    """The one run the tracker holds, and its train_loss points, now."""
    (run,) = tracked_runs(uri)
    return SimpleNamespace(run=run, points=history(uri, run.info.run_id, "train_loss"))


@pytest.fixture(scope="module")
def tracked(stopped_torchrun_run, tiny_data):
    """One run (DDP_FLAGS: 2 epochs) tracked in a SQLite file through three starts: torchrun with 2 processes,
    stopped by SIGTERM in its second epoch (the suite's stopped_torchrun_run, which test_preemption resumes too, in
    copies, untracked); resumed with --auto-resume in one process (this one: the launch script started without
    torchrun), which trains that epoch to its end but cannot write its checkpoint (a full disk); resumed again, to
    the end. A SimpleNamespace: the tracker's `uri`, the run's folder (`out`), and what the tracker held after the
    stop (`stopped`; all its runs: `stopped_runs`) and after the failure (`failed`), and what the torchrun run
    printed on stderr (`stop_stderr`)."""
    stop, out, _, uri = stopped_torchrun_run
    flags = ("--data-path", tiny_data, *DDP_FLAGS, "--output-dir", out, "--tracking-uri", uri)
    with mlflow_settings():
        stopped_runs = tracked_runs(uri)  # the first test checks there is one, and no warning (stop_stderr)
        stopped = seen(uri) if len(stopped_runs) == 1 else None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(run_log, "save_epoch", full_disk)
            on_full_disk = run_here("train_multi_gpu_using_launch.py", *flags, "--auto-resume")
        status, printed = on_full_disk.returncode, on_full_disk.stdout + on_full_disk.stderr
        assert status == 2 and "No space left on device" in printed, printed
        failed = seen(uri)
        ended = run_here("train_multi_gpu_using_launch.py", *flags, "--auto-resume")
        status, printed = ended.returncode, ended.stdout + ended.stderr
    assert status == 0 and "Resuming from" in printed and "warning:" not in printed, printed
    return SimpleNamespace(
        uri=uri, out=out, stopped=stopped, failed=failed, stopped_runs=stopped_runs, stop_stderr=stop.stderr
    )


def test_a_torchrun_run_stopped_failed_and_resumed_on_one_process_is_one_tracked_run_marked_as_it_ended(tracked):
    assert len(tracked.stopped_runs) == 1 and "warning:" not in tracked.stop_stderr, tracked.stop_stderr  # not 1 a rank
    (run,) = tracked_runs(tracked.uri)  # nor one per start
    assert run.info.run_id == tracked.stopped.run.info.run_id == tracked.failed.run.info.run_id
    statuses = [start.run.info.status for start in (tracked.stopped, tracked.failed)] + [run.info.status]
    assert statuses == ["KILLED", "FAILED", "FINISHED"]
    assert json.loads((tracked.out / TRACKED_RUN_NAME).read_text())["run_id"] == run.info.run_id
    assert load_checkpoint(tracked.out / "checkpoint.pth")["tracked_run"]["run_id"] == run.info.run_id
    assert run.info.run_name == tracked.out.name


def test_each_epoch_is_logged_once_with_the_figures_of_the_run_that_finished_it(tracked):
    # Epoch 1 was trained three times: stopped in its middle, finished without its checkpoint, then finished (from
    # the step where it stopped) by the last start. An epoch is logged once its checkpoint is saved: once.
    epochs = [json.loads(line) for line in (tracked.out / "metrics.jsonl").read_text().splitlines()]
    assert tracked.stopped.points == tracked.failed.points == [(0, epochs[0]["train_loss"])]
    assert [line["world_size"] for line in epochs] == [2, 1]
    run_id = tracked.stopped.run.info.run_id
    for key in ("train_loss", "val_acc", "val_correct", "lr", "epoch_seconds", "train_images_per_sec", "world_size"):
        assert history(tracked.uri, run_id, key) == [(line["epoch"], line[key]) for line in epochs], key
    best = [max(line["val_acc"] for line in epochs[: i + 1]) for i in range(len(epochs))]
    assert [value for _, value in history(tracked.uri, run_id, "best_val_acc")] == best


def test_the_tracked_run_holds_the_recipe_as_parameters_and_the_run_as_tags_and_artifacts(tracked):
    from mlflow.tracking import MlflowClient

    uri, out = tracked.uri, tracked.out
    (run,) = tracked_runs(uri)
    record = json.loads((out / "args.json").read_text())
    assert run.data.params == {name: str(record[name]) for name in Config.recipe_fields()}
    tags = run.data.tags
    assert (tags["world_size"], tags["script"], tags["torch"]) == (
        "1",
        "train_multi_gpu_using_launch",
        torch.__version__,
    )
    assert tags["amp"] == record["amp"] and tags["cpu"] and tags["output_dir"] == str(out)
    artifacts = {artifact.path for artifact in MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert {"args.json", "training_curves.png"} <= artifacts
    assert (out.parent / "mlartifacts" / EXPERIMENT).is_dir()  # beside the SQLite file, not in the current folder


def settled(tracking: Tracking) -> None:
    """Wait until the tracking thread has made every call queued so far."""
    done = threading.Event()
    tracking.call(done.set)
    assert done.wait(60)


def epoch_line(epoch: int, val_acc: float) -> dict:
    return {"epoch": epoch, "train_loss": 1.0 / (epoch + 1), "val_acc": val_acc, "lr": 0.1, "world_size": 1}


@pytest.mark.fast
def test_a_restart_continues_the_tracked_run_logs_the_epochs_it_lacks_and_marks_each_end(tmp_path):
    # A run tracked in a folder (a local store) logs epoch 0 and stops; the restart finds the tracked run in the
    # run's folder, marks it running, logs epoch 1 that the tracker missed from metrics.jsonl's lines, and fails.
    uri, out = str(tmp_path / "mlruns"), tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text("{}")
    config, plan = Config(tracking_uri=uri), SimpleNamespace(output_dir=out, tracked_run=None)
    first = Tracking(config, plan, Config(epochs=3).record(), torch.device("cpu"))
    first.start([], 0)
    named = first.checkpoint_entry()  # the first checkpoint, written as the tracker is still making the run
    first.epoch(epoch_line(0, 0.5))
    with pytest.raises(SystemExit), first.marks_how_the_run_ends():
        raise SystemExit(143)  # a stop by signal
    (run,) = tracked_runs(uri)
    assert run.info.status == "KILLED" and history(uri, run.info.run_id, "val_acc") == [(0, 0.5)]
    assert named == {"tracked_run": {"tracking_uri": uri, "run_id": run.info.run_id}}

    again = Tracking(config, plan, Config(epochs=3).record(), torch.device("cpu"))
    again.start([epoch_line(0, 0.5), epoch_line(1, 0.25)], 2)
    assert again.checkpoint_entry() == named  # at once: the run's folder names it
    settled(again)
    (run,) = tracked_runs(uri)
    assert run.info.status == "RUNNING"
    assert history(uri, run.info.run_id, "val_acc") == [(0, 0.5), (1, 0.25)]
    assert history(uri, run.info.run_id, "best_val_acc") == [(0, 0.5), (1, 0.5)]
    with pytest.raises(RuntimeError), again.marks_how_the_run_ends():
        raise RuntimeError("a crash")
    (run,) = tracked_runs(uri)
    assert run.info.status == "FAILED" and again.checkpoint_entry()["tracked_run"]["run_id"] == run.info.run_id


# A record of the tracked run (tracked_run.json, or a checkpoint's "tracked_run") damaged, and what its warning says
DAMAGED_RECORDS = {
    "run id not a string": (b'{"run_id": 3}', "is damaged (run_id is an integer, not a string)"),
    "no run id": (b'{"tracking_uri": "mlruns"}', "is damaged (run_id is missing)"),
    "cut short": (b'{"run_id": "3f2a', "is not valid JSON"),
    "a list": (b'["3f2a"]', "holds a list, not an object"),
    "empty": (b"", "is not valid JSON"),
    "not text": (b"\xff\xfe\x00\x81", "is not a text file"),
}


def tracking_in(out, uri) -> Tracking:
    """A run's Tracking in the folder `out` (holding its args.json), tracked at `uri`, resuming no checkpoint."""
    config, plan = Config(tracking_uri=str(uri)), SimpleNamespace(output_dir=out, tracked_run=None)
    return Tracking(config, plan, Config(epochs=3).record(), torch.device("cpu"))


@pytest.mark.fast
@pytest.mark.parametrize("damage", DAMAGED_RECORDS)
def test_a_damaged_record_of_the_tracked_run_is_one_warning_naming_it(damage, tmp_path, capsys):
    content, said = DAMAGED_RECORDS[damage]
    (tmp_path / TRACKED_RUN_NAME).write_bytes(content)
    assert read_tracked_run(tmp_path) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: tracked run file {tmp_path / TRACKED_RUN_NAME}") and said in line, line
    assert line.endswith(": tracking as a new run")
    assert read_tracked_run(tmp_path / "absent") is None and not capsys.readouterr().err


@pytest.mark.fast
def test_a_run_whose_record_is_damaged_is_tracked_anew_with_every_epoch_it_finished(tmp_path, capsys):
    # The record damaged in the folder and in the checkpoint resumed: one warning for each, then a new tracked run
    # holding the epochs of metrics.jsonl that the lost one had, its id written over the damaged file.
    uri, out = tmp_path / "mlruns", tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text("{}")
    (out / TRACKED_RUN_NAME).write_text('{"run_id": "3f2a"')
    tracking = tracking_in(out, uri)
    tracking.tracked_run = ["3f2a"]  # the checkpoint's entry, damaged
    tracking.start([epoch_line(0, 0.5), epoch_line(1, 0.25)], 2)
    settled(tracking)
    tracking.end("FINISHED")
    warnings = capsys.readouterr().err.splitlines()
    assert [line.split(" is ")[0] for line in warnings] == [
        "warning: the checkpoint's tracked run",
        f"warning: tracked run file {out / TRACKED_RUN_NAME}",
    ], warnings
    (run,) = tracked_runs(str(uri))
    assert run.info.status == "FINISHED" and history(str(uri), run.info.run_id, "val_acc") == [(0, 0.5), (1, 0.25)]
    assert read_tracked_run(out)["run_id"] == run.info.run_id == tracking.checkpoint_entry()["tracked_run"]["run_id"]


@pytest.fixture(scope="module")
def two_tracked_runs(tmp_path_factory):
    """A folder store holding this run's tracked run, which logged epoch 0 and was stopped, and another run's, which
    logged epochs 0 and 1 of other figures: (the store's uri, this run's record as its start wrote it, the other's
    id)."""
    root = tmp_path_factory.mktemp("two_runs")
    uri, ids = str(root / "mlruns"), []
    with mlflow_settings(), contextlib.redirect_stdout(io.StringIO()):
        for name, lines in (("this", [epoch_line(0, 0.5)]), ("other", [dict(epoch_line(0, 0.4), train_loss=0.7)] * 2)):
            (root / name).mkdir()
            (root / name / "args.json").write_text("{}")
            tracking = tracking_in(root / name, uri)
            tracking.start([], 0)
            for epoch, line in enumerate(lines):
                tracking.epoch(dict(line, epoch=epoch))
            tracking.end("KILLED")
            ids.append(read_tracked_run(root / name)["run_id"])
    return uri, (root / "this" / TRACKED_RUN_NAME).read_bytes(), ids[1]


def damaged_entries(record: dict, other_id: str):
    """A record of the tracked run damaged: one character of its id changed (to one the tracker rejects, as `%`, or
    to any), another run's id, or any part of it reshaped."""
    run_id = record["run_id"]
    changed = st.tuples(st.integers(0, len(run_id) - 1), st.sampled_from("%/ .") | st.characters())
    ids = changed.map(lambda change: run_id[: change[0]] + change[1] + run_id[change[0] + 1 :]) | st.just(other_id)
    return ids.map(lambda new: dict(record, run_id=new)) | reshaped(record, inside=True) | JSON


@pytest.mark.fast
@given(data=st.data())
@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
def test_a_record_of_the_tracked_run_damaged_in_any_way_is_recovered_with_every_finished_epoch(two_tracked_runs, data):
    # The restart of this run (epochs 0 and 1 finished), its record damaged in its folder's file (any byte changed,
    # cut short, any id) or in the checkpoint resumed (any id, any shape): a tracked run of this run's epochs,
    # each once, named by the file and the next checkpoint; at most one warning, and the tracker never given up.
    uri, written, other_id = two_tracked_runs
    record = json.loads(written)
    entries = damaged_entries(record, other_id)
    in_file = data.draw(st.booleans(), label="in the file")
    file_damage = damaged(written, record).map(lambda damage: damage.data)
    file_damage |= entries.map(lambda entry: json.dumps(entry).encode())
    damage = data.draw(file_damage if in_file else entries, label="damaged")
    finished = [epoch_line(0, 0.5), epoch_line(1, 0.25)]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        (out / "args.json").write_text("{}")
        if in_file:
            (out / TRACKED_RUN_NAME).write_bytes(damage)
        tracking, stderr = tracking_in(out, uri), io.StringIO()
        tracking.tracked_run = None if in_file else damage
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            tracking.start(finished, 2)
            tracking.end("FINISHED")  # after every call queued
        warnings = stderr.getvalue().splitlines()
        assert len(warnings) <= 1 and not any(" failed (" in line for line in warnings), warnings
        named = read_tracked_run(out)["run_id"]
        assert tracking.checkpoint_entry()["tracked_run"]["run_id"] == named
    from mlflow.tracking import MlflowClient

    assert history(uri, named, "train_loss") == [(line["epoch"], line["train_loss"]) for line in finished]
    assert MlflowClient(uri).get_run(named).info.status == "FINISHED"


def a_folder_in_its_place(tmp_path):
    (tmp_path / "mlflow.db").mkdir()
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "mlruns"


# Trackers that cannot be opened (MLflow's own retries, else tried at once): each costs one warning and seconds
TRACKERS_THAT_FAIL = {
    "a SQLite file with a folder in its place": (a_folder_in_its_place, "unable to open database file"),
    "a folder under a file": (under_a_file, "Not a directory"),
    "a server that is not there": (lambda tmp_path: f"http://127.0.0.1:{find_free_port()}", "Connection refused"),
}


@pytest.mark.parametrize("tracker", TRACKERS_THAT_FAIL)
def test_a_tracker_that_cannot_be_opened_costs_one_warning_and_seconds(tracker, tmp_path, capsys):
    make, reason = TRACKERS_THAT_FAIL[tracker]
    uri, out = make(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text("{}")
    tracking = tracking_in(out, uri)
    started = time.monotonic()
    tracking.start([], 0)
    tracking.epoch(epoch_line(0, 0.5))
    tracking.end("FINISHED")
    seconds = time.monotonic() - started  # MLflow's own retries of a database: 102 s
    (line,) = capsys.readouterr().err.splitlines()  # none of MLflow's log lines
    assert line.startswith(f"warning: MLflow tracking at {uri} failed (") and reason in line, line
    assert seconds < 30 and tracking.checkpoint_entry() == {} and not (out / TRACKED_RUN_NAME).exists()


@pytest.mark.parametrize("store", ["sqlite", "folder"])
def test_a_tracker_removed_while_the_run_trains_costs_one_warning(store, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else str(tmp_path / "mlruns")
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text("{}")
    tracking = tracking_in(out, uri)
    tracking.start([], 0)
    tracking.epoch(epoch_line(0, 0.5))
    settled(tracking)
    (run,) = tracked_runs(uri)
    removed = tmp_path / ("mlflow.db" if store == "sqlite" else "mlruns")
    removed.unlink() if store == "sqlite" else shutil.rmtree(removed)
    tracking.epoch(epoch_line(1, 0.25))
    tracking.epoch(epoch_line(2, 0.75))
    tracking.end("FINISHED")
    (line,) = capsys.readouterr().err.splitlines()  # not MLflow's traceback
    assert line.startswith(f"warning: MLflow tracking at {uri} failed (") and "Traceback" not in line, line
    assert read_tracked_run(out)["run_id"] == run.info.run_id  # a resume on the tracker restored logs what it lacks


def test_a_run_refused_in_its_first_epoch_leaves_its_folder_to_the_corrected_command_tracked_anew(
    tiny_data, tmp_path, monkeypatch
):
    # The first start tracked, then stopped in its first epoch by a refusal (as too many unreadable images stop it):
    # its folder holds args.json, class_indices.json, tb/ and tracked_run.json, no finished epoch
    script, uri, out = importlib.import_module("train_single_gpu"), str(tmp_path / "mlruns"), tmp_path / "run"
    flags = ("--data-path", tiny_data, *REFERENCE_FLAGS, "--output-dir", out, "--tracking-uri", uri)

    def refused(*args, **options):
        raise UserError("12 of epoch 0's training images could not be read, more than the 1 (1 %) ...")

    with monkeypatch.context() as first_epoch:
        first_epoch.setattr(script, "train_one_epoch", refused)
        stopped = run_here("train_single_gpu.py", *flags)
    assert stopped.returncode == 2 and not (out / "metrics.jsonl").exists()
    (failed,) = tracked_runs(uri)
    assert failed.info.status == "FAILED" and read_tracked_run(out)["run_id"] == failed.info.run_id

    corrected = run_here("train_single_gpu.py", *flags, "--epochs", "1")  # the same folder, fewer epochs
    assert corrected.returncode == 0, corrected.stderr
    held = "(args.json, class_indices.json, tb/*, tracked_run.json): this run starts there anew"
    assert f"{out} held the start of a run that ended before its first epoch did {held}" in corrected.stdout
    assert json.loads((out / "args.json").read_text())["epochs"] == 1 and len(list((out / "tb").iterdir())) == 1
    runs = {run.info.run_id: run for run in tracked_runs(uri)}  # the failed start's, marked as it ended, and a new one
    new = read_tracked_run(out)["run_id"]
    assert runs.keys() == {failed.info.run_id, new} and runs[failed.info.run_id].info.status == "FAILED"
    assert runs[new].info.status == "FINISHED" and history(uri, new, "val_acc")[0][0] == 0
