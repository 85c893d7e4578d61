"""Stopping at a step all ranks agree on, saved; resuming exactly (docs/resuming-and-failures.md, Stopped at a step)."""

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path

from multi_train_utils.checkpoint import load_checkpoint, restore, save_atomically
from multi_train_utils.distributed_utils import on_main_process, print_once
from utils import STOP_SIGNALS, OutputError

noted: list[int] = []  # the stop signals received inside stop_signals_noted


@dataclass
class Midway:
    """Where a run stopped at a step left its epoch, as its checkpoint's "midway" holds it."""

    step: int
    totals: list[float]
    lr: float
    seconds: float = 0.0

    @classmethod
    def of(cls, state: dict) -> "Midway | None":
        """A checkpoint's; None if it stopped at an epoch's end. One saved before the seconds were kept counts none."""
        if (midway := state.get("midway")) is None:
            return None
        return cls(midway["step"], midway["totals"], midway["lr"], midway.get("seconds", 0.0))


class StopRequested(Exception):
    """A stop signal arrived: raised on every process after the same optimizer step (`step`: batches trained)."""

    def __init__(self, signum: int, epoch: int, step: int, totals: list[float], lr: float, seconds: float):
        super().__init__(f"stopped by {signal.Signals(signum).name} at epoch {epoch}, step {step}")
        self.signum, self.epoch, self.step, self.totals, self.lr = signum, epoch, step, totals, lr
        self.seconds = seconds

    def midway(self) -> dict:
        return {"step": self.step, "totals": self.totals, "lr": self.lr, "seconds": self.seconds}


@contextlib.contextmanager
def stop_signals_noted():
    """Inside, SIGTERM and SIGUSR1 are noted for train_one_epoch, not ending the process; in the main thread alone."""
    before = {signum: signal.signal(signum, lambda received, frame: noted.append(received)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        noted.clear()


def stop_votes() -> list[float]:
    """1.0 per stop signal (STOP_SIGNALS' order) this process received, else 0.0, to be summed over the processes."""
    return [float(signum in noted) for signum in STOP_SIGNALS]


def agreed_signal(votes) -> int | None:
    """The stop signal the summed `votes` say some process received (the first, in STOP_SIGNALS' order), or None."""
    return next((signum for signum, vote in zip(STOP_SIGNALS, votes, strict=True) if vote > 0), None)


@contextlib.contextmanager
def saving_a_step_on_stop(log, model, training):
    """Inside, a stop signal ends the run at a step all ranks agree on, rank 0 saving it; all exit with 128 + signal."""
    with stop_signals_noted(), log.ending():
        try:
            yield
        except StopRequested as stop:
            on_main_process(save_step, log, model, training, stop)
            raise SystemExit(128 + stop.signum) from None  # as a shell reports a process the signal ended


def save_step(log, model, training, stop: StopRequested) -> None:
    """Save the training state at `stop` with its "midway", once the last epoch's files are written."""
    log.wait_for_writes()
    state = log.training_state(stop.epoch - 1, model, training) | log.tracking.checkpoint_entry()
    try:
        save_atomically(state | {"midway": stop.midway()}, log.checkpoint)
    except OutputError as error:
        kept = "the last epoch's checkpoint is untouched"
        raise OutputError(f"{error}; stopped by a signal, {kept}: once it can be written, {log.continuing()}") from None
    print(f"{stop}: saved in {log.checkpoint}; to continue from this step, {log.continuing()}", flush=True)


def resume_from(checkpoint: Path | None, model, training, epochs: int) -> tuple[int, float]:
    """(first epoch, best validation accuracy) from `checkpoint`, saying so, else (0, -1); sets `training.midway`."""
    if checkpoint is None:
        return 0, -1.0
    state = load_checkpoint(checkpoint)
    start_epoch, best_acc = restore(state, model, training, checkpoint)
    training.midway = Midway.of(state)
    at_step = f", step {training.midway.step}" if training.midway is not None else ""
    print_once(f"Resuming from {checkpoint}: epoch {start_epoch}{at_step} of {epochs}, "
               f"best val acc so far {best_acc:.3f}")  # fmt: skip
    return start_epoch, best_acc
