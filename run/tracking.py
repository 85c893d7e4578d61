"""Experiment tracking with MLflow: rank 0 logs a run to one tracked run, the same through every stop, restart and
resume; off unless --tracking-uri or MLFLOW_TRACKING_URI names a tracker (a server: one found reachable). Every call
to the tracker runs in one background thread, so a failing tracker costs the run one warning and nothing else
(docs/tracking.md)."""

import contextlib
import json
import os
import platform
import queue
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import torch

from machine import describe_cpu, physical_memory
from read_back import misfits, read_json
from run.config import Config
from run.metrics import epoch_accuracy
from utils import UserError, in_brief, warn, write_json

TRACKED_RUN_NAME = "tracked_run.json"  # in a run's folder: {"tracking_uri": ..., "run_id": ...}
EXPERIMENT = "flowers"  # the experiment a run is tracked in, unless MLFLOW_EXPERIMENT_NAME names another
# MLflow's settings in this process, unless the environment sets them: bounded waits, none of MLflow's own log lines,
# a folder store allowed, no telemetry (docs/tracking.md, "When the tracker fails", says why each).
MLFLOW_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_LOGGING_LEVEL": "CRITICAL",
                   "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}  # fmt: skip
# Tries to open a database tracker: MLflow's MAX_RETRY_COUNT (no variable sets it), whose 10 wait 102 s; 3 wait 0.4 s
DATABASE_TRIES = 3
# Seconds the end of a run waits for what is queued: after training (the weights' upload too), after a stop or failure
FINISH_WAIT, STOP_WAIT = 120.0, 10.0
SERVER_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}  # where a URI names none
PROJECT = Path(__file__).resolve().parents[1]


class Tracking:
    """The tracked run of the run in `plan.output_dir`, from start() to end(). Off (no tracker named, or `enabled`
    false: every rank but 0 in DDP), it only keeps the resumed checkpoint's entry for the next checkpoint."""

    def __init__(self, config: Config, plan, record: dict, device: torch.device, enabled: bool = True):
        self.uri = config.tracking_uri if enabled else None  # reachable_tracker's
        self.output_dir, self.record, self.device = plan.output_dir, record, device
        self.track_weights = config.track_weights
        self.tracked_run = plan.tracked_run  # the checkpoint's entry, until this run opens its tracked run
        self.run_id, self.client, self.thread, self.failed = None, None, None, False
        self.epochs: list[dict] = []  # the epochs logged, metrics.jsonl's lines: the training curves' points
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.opened = threading.Event()  # set once the tracker has opened the tracked run, or failed to
        self.warned = threading.Lock()  # taken by the one warning a run gives

    def start(self, finished: list[dict], start_epoch: int) -> None:
        """Open, in the background, the tracked run the checkpoint or the run's folder names (else a new one) and log
        the `finished` epochs it lacks. Call once args.json is written and metrics.jsonl ends before `start_epoch`."""
        if self.uri is None:
            return
        for name, value in MLFLOW_SETTINGS.items():
            os.environ.setdefault(name, value)
        known = read_tracked_run(self.output_dir, self.tracked_run)
        self.tracked_run = known  # the checkpoints name it from now, whenever the tracker answers
        print(f"Tracking: MLflow at {shown(self.uri)}, experiment {experiment_name()}", flush=True)
        self.thread = threading.Thread(target=self.work, name="mlflow-tracking", daemon=True)
        self.thread.start()
        self.call(self.open, known, sorted(finished, key=lambda line: line["epoch"]), start_epoch)

    def epoch(self, metrics: dict) -> None:
        """Log an epoch whose checkpoint is saved (never before: an epoch trained again is never logged twice)."""
        self.call(self.log_epochs, [metrics])

    def checkpoint_entry(self) -> dict:
        """A checkpoint's "tracked_run", for a resume to continue; waits at most STOP_WAIT s for a new run's id."""
        if self.tracked_run is None and self.thread is not None:
            self.opened.wait(STOP_WAIT)
        return {"tracked_run": self.tracked_run} if self.tracked_run is not None else {}

    @contextlib.contextmanager
    def marks_how_the_run_ends(self):
        """Inside, the epochs: a stop (SystemExit, Ctrl-C) marks the tracked run KILLED, any other exception FAILED."""
        try:
            yield
        except (SystemExit, KeyboardInterrupt):
            self.end("KILLED")
            raise
        except BaseException:
            self.end("FAILED")
            raise

    def end(self, status: str) -> None:
        """Mark the tracked run `status` (FINISHED, KILLED, FAILED), after what is queued, waiting a bounded time."""
        if self.thread is None:
            return
        self.call(self.close, status)
        self.calls.put(None)
        wait = FINISH_WAIT if status == "FINISHED" else STOP_WAIT
        self.thread.join(wait)
        if self.thread.is_alive():
            self.warn_once(f"the tracker at {shown(self.uri)} took more than {wait:g} s: the run ends without "
                           "waiting for it")  # fmt: skip
        self.thread = None

    # What follows runs in the background thread, in the order queued.

    def call(self, function, *args) -> None:
        if self.thread is not None:
            self.calls.put((function, args))

    def work(self) -> None:
        for function, args in iter(self.calls.get, None):  # None: the last call
            if self.failed:
                continue
            try:
                function(*args)
            except Exception as error:  # whatever the tracker or its client raises: the run goes on without it
                self.failed = True
                self.opened.set()  # nor will it open the run now: no checkpoint waits for it
                reason = in_brief(f"{type(error).__name__}: {error}")
                self.warn_once(f"MLflow tracking at {shown(self.uri)} failed ({reason}): the run goes on untracked; "
                               "a resume of the run logs the epochs the tracker missed")  # fmt: skip

    def warn_once(self, message: str) -> None:
        if self.warned.acquire(blocking=False):
            warn(message)

    def open(self, known: dict | None, finished: list[dict], start_epoch: int) -> None:
        import mlflow.store.db.utils
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        mlflow.store.db.utils.MAX_RETRY_COUNT = DATABASE_TRIES
        self.client = MlflowClient(self.uri)
        run, logged = self.continued(known["run_id"], finished, start_epoch) if known else (None, set())
        if run is None:
            run = self.client.create_run(self.experiment_id(), run_name=self.output_dir.name)
            recipe = [Param(name, str(self.record[name])) for name in Config.recipe_fields() if name in self.record]
            self.client.log_batch(run.info.run_id, params=recipe)
        elif run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self.tracked_run = {"tracking_uri": self.uri, "run_id": self.run_id}
        write_json(self.output_dir / TRACKED_RUN_NAME, self.tracked_run)
        self.opened.set()
        self.client.log_batch(self.run_id, tags=[RunTag(name, value) for name, value in self.tags().items()])
        self.client.log_artifact(self.run_id, str(self.output_dir / "args.json"))
        self.epochs = [line for line in finished if line["epoch"] in logged]
        self.log_epochs([line for line in finished if line["epoch"] not in logged])

    def continued(self, run_id: str, finished: list[dict], start_epoch: int):
        """(the tracked run `run_id`, the epochs it logged), or (None, none) and a note where this tracker has no run
        of that id whose epochs are this run's before `start_epoch`: deleted, tracked elsewhere, an id it rejects,
        another run's (other figures), or a later copy's (a resume of an older checkpoint: logged twice, else)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            run = None
        points = self.client.get_metric_history(run_id, "train_loss") if run is not None else []
        ours = {line["epoch"]: line["train_loss"] for line in finished}  # none, resumed into a new folder
        other = any(p.step >= start_epoch or ours.get(p.step, p.value) != p.value for p in points)
        if run is None or run.info.lifecycle_stage == "deleted" or other:
            print(f"note: {shown(self.uri)} has no tracked run {run_id!r} of this run's epochs (deleted, tracked "
                  "elsewhere, another run's, or a later copy's): tracking as a new run")  # fmt: skip
            return None, set()
        return run, {point.step for point in points}

    def experiment_id(self) -> str:
        """The experiment's id, made if need be, with its artifacts beside a SQLite file (not in the current folder)."""
        from mlflow.exceptions import MlflowException

        name = experiment_name()
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts" / name).as_uri()
        try:  # tagged as model training, so that MLflow's UI opens on its runs and their charts, not on traces
            tags = {"mlflow.experimentKind": "custom_model_development"}
            return self.client.create_experiment(name, location, tags=tags)
        except MlflowException:  # another run made it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def log_epochs(self, lines: list[dict]) -> None:
        """Log the epochs of metrics.jsonl's `lines`, with the best accuracy so far, and the curves of all logged."""
        from mlflow.entities import Metric

        if not lines:
            return
        now, metrics = int(time.time() * 1000), []
        for line in lines:
            self.epochs = sorted([*self.epochs, line], key=lambda epoch: epoch["epoch"])
            best = max(epoch_accuracy(epoch) for epoch in self.epochs if epoch["epoch"] <= line["epoch"])
            numbers = {key: value for key, value in line.items() if is_number(value) and key != "epoch"}
            numbers["best_val_acc"] = best
            metrics += [Metric(key, float(value), now, line["epoch"]) for key, value in numbers.items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        from plot_results import plot_curves, run_label  # matplotlib: imported here, by the thread alone

        figure = plot_curves([(run_label(self.output_dir, self.epochs), self.epochs)])
        self.client.log_figure(self.run_id, figure, "training_curves.png")

    def close(self, status: str) -> None:
        if self.run_id is None:
            return
        best = self.output_dir / "weights" / "best.pth"
        if status == "FINISHED" and self.track_weights and best.exists():
            self.client.log_artifact(self.run_id, str(best), "weights")
        self.client.set_terminated(self.run_id, status)

    def tags(self) -> dict:
        """This start's tags (each start replaces them): the flags that are not the recipe, and the machine."""
        plain = lambda value: json.dumps(value) if isinstance(value, dict | list) else str(value)  # noqa: E731
        tags = {name: plain(value) for name, value in self.record.items() if name not in Config.recipe_fields()}
        tags |= {
            "mlflow.source.name": f"{self.record.get('script', 'train_single_gpu')}.py",
            "mlflow.source.type": "LOCAL",
            "host": platform.node(),
            "cpu": describe_cpu(),
            "memory_gib": f"{(physical_memory() or 0) / 2**30:.0f}",
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
        if self.device.type == "cuda":
            tags["gpu"] = torch.cuda.get_device_name(self.device)
        if commit := git_commit():
            tags["mlflow.source.git.commit"] = commit
        return tags


def reachable_tracker(config: Config) -> Config:
    """`config` naming its tracker (--tracking-uri, else MLFLOW_TRACKING_URI), or none where that is a server this
    machine cannot connect to, said in one warning: found before anything is loaded (a proxy's server is not tried)."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
    where = urllib.parse.urlsplit(uri or "")
    scheme = where.scheme.split("+")[0]  # postgresql+psycopg2: the driver named
    try:
        port = where.port or SERVER_PORTS.get(scheme)
        proxied = scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(where.hostname or "")
        if where.hostname and port and not proxied:
            wait = float(MLFLOW_SETTINGS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
            socket.create_connection((where.hostname, port), timeout=wait).close()
    except (OSError, ValueError) as error:  # refused, no such host, timed out; a port that is no number
        reason = f"cannot connect to {where.netloc.rpartition('@')[2]}: {getattr(error, 'strerror', None) or error}"
        warn(f"MLflow tracking at {shown(uri)} failed ({reason}): the run goes on untracked; a resume of the run "
             "logs the epochs the tracker missed")  # fmt: skip
        uri = None
    return replace(config, tracking_uri=uri)


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def git_commit() -> str | None:
    """The project's commit, where it is a git checkout and git is installed; else None."""
    try:
        answer = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.strip() if answer.returncode == 0 and answer.stdout.strip() else None


def read_tracked_run(folder: Path, saved: dict | None = None) -> dict | None:
    """The tracked run that the resumed checkpoint names (`saved`), else the one the run in `folder` names
    (TRACKED_RUN_NAME), if any; a damaged record names none, with a warning."""
    path = folder / TRACKED_RUN_NAME
    records = {
        "the checkpoint's tracked run": lambda: saved,
        f"tracked run file {path}": lambda: read_json(path, "tracked run file") if path.exists() else None,
    }
    try:
        for source, read in records.items():
            if (entry := read()) is None:
                continue
            if not (damage := misfits(entry, {"run_id": str})):
                return entry
            warn(f"{source} is damaged ({'; '.join(damage)}): tracking as a new run")
    except UserError as error:
        warn(f"{error}: tracking as a new run")
    return None


def shown(uri: str) -> str:
    """`uri` as printed: a password in it (a database's, a server's) as ***."""
    where = urllib.parse.urlsplit(uri)
    if where.password is None:
        return uri
    return where._replace(netloc=where.netloc.replace(f":{where.password}@", ":***@", 1)).geturl()
