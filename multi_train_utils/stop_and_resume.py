"""Stopping at a step, and resuming: a signal that asks a run to stop ends it at a training step that every process
agrees on, saved, so that the resumed run continues from that step exactly instead of training the epoch again;
and a run resumed from its checkpoint, an epoch's or such a step's (resume_from).

The signals: SIGTERM, which SLURM, Kubernetes and torchrun send before they kill (SLURM on preemption, at the time
limit and on `scancel`), and SIGUSR1, which SLURM's `--signal` sends ahead of the time limit (Windows has no
SIGUSR1). While a run is inside `stop_signals_noted`, the handler only notes the signal; train_one_epoch sums each
process's note (`stop_votes`) over the processes with the step's loss, so every process learns of it at the same
step whichever one received it, and the first optimizer step from there is the last (`StopRequested`). Rank 0
saves that step (`saving_a_step_on_stop`) while the others wait. A second signal while it is being saved changes
nothing: the note is taken, and the checkpoint is written atomically. The resumed run's train_one_epoch skips the
batches trained already (`Midway`); each step draws from a seed of its own (EpochSteps.seed_random_draws), so the
steps it trains draw what they would have drawn.
"""

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path

from multi_train_utils.checkpoint import load_checkpoint, restore, save_atomically
from multi_train_utils.distributed_utils import on_main_process, print_once
from utils import STOP_SIGNALS, OutputError

noted: list[int] = []  # the stop signals this process received while they were noted


@dataclass
class Midway:
    """Where a run stopped at a step left its epoch: the batches trained, the epoch's sums so far (train_one_epoch's
    totals), the epoch's first learning rate (the one its metrics report) and the seconds it had trained (so that
    the epoch's time and speed count its whole training, not the part after the resume), as its checkpoint holds
    them; the resumed run's train_one_epoch continues from there."""

    step: int
    totals: list[float]
    lr: float
    seconds: float = 0.0

    @classmethod
    def of(cls, state: dict) -> "Midway | None":
        """Where the run whose checkpoint `state` is stopped in its epoch; None if it stopped at an epoch's end. A
        checkpoint saved before the seconds were kept counts none."""
        midway = state.get("midway")
        if midway is None:
            return None
        return cls(midway["step"], midway["totals"], midway["lr"], midway.get("seconds", 0.0))

    def skip_trained_batches(self, data_loader) -> None:
        """The loader's next pass starts at this step (its batch sampler must be a SeededBatchSampler, as
        shuffled_batches makes)."""
        data_loader.batch_sampler.start_at(self.step)


class StopRequested(Exception):
    """Raised on every process after the optimizer step of `step` of `epoch`: a stop signal arrived. `step` is the
    number of the epoch's batches trained, `totals` the epoch's sums so far (train_one_epoch's), `lr` the epoch's
    first learning rate, `seconds` the epoch's training time so far."""

    def __init__(self, signum: int, epoch: int, step: int, totals: list[float], lr: float, seconds: float):
        super().__init__(f"stopped by {signal.Signals(signum).name} at epoch {epoch}, step {step}")
        self.signum, self.epoch, self.step, self.totals, self.lr = signum, epoch, step, totals, lr
        self.seconds = seconds

    @property
    def status(self) -> int:
        """The exit status: 128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + self.signum

    def midway(self) -> dict:
        """What a checkpoint keeps of the stop, beside the training state ("midway"; restore reads it back)."""
        return {"step": self.step, "totals": self.totals, "lr": self.lr, "seconds": self.seconds}


@contextlib.contextmanager
def stop_signals_noted():
    """Inside, SIGTERM and SIGUSR1 are noted for train_one_epoch instead of ending the process; outside, they do
    what they did before. Call it in the main thread (Python runs signal handlers there only)."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda received, frame: noted.append(received))
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        noted.clear()


def stop_votes() -> list[float]:
    """One number per stop signal (STOP_SIGNALS' order): 1.0 where this process has received it. Summed over the
    processes, a number above 0 means some process has."""
    return [float(signum in noted) for signum in STOP_SIGNALS]


def agreed_signal(votes) -> int | None:
    """The stop signal the summed `votes` say some process received (the first, in STOP_SIGNALS' order), or None."""
    return next((signum for signum, vote in zip(STOP_SIGNALS, votes, strict=True) if vote > 0), None)


@contextlib.contextmanager
def saving_a_step_on_stop(log, model, training):
    """Inside, a stop signal (SIGTERM, SIGUSR1) ends the run at a training step every rank agrees on: rank 0 saves
    that step as the checkpoint, while the others wait for it, and every process exits with status 128 + the
    signal. --auto-resume (or --resume) continues from that step. `log` (a run_log.RunLog) gives the checkpoint's
    state and where it goes, and marks the tracked run stopped, or failed on any other exception (RunLog.ending)."""
    with stop_signals_noted(), log.ending():
        try:
            yield
        except StopRequested as stop:
            on_main_process(save_step, log, model, training, stop)
            raise SystemExit(stop.status) from None


def save_step(log, model, training, stop: StopRequested) -> None:
    """The checkpoint of a run stopped at step `stop.step` of epoch `stop.epoch`: the training state then, and
    where in the epoch it is (its "midway"), once the last epoch's files are written (the background's)."""
    log.wait_for_writes()
    state = log.training_state(stop.epoch - 1, model, training) | log.tracking.checkpoint_entry()
    try:
        save_atomically(state | {"midway": stop.midway()}, log.checkpoint)
    except OutputError as error:
        raise OutputError(f"{error}; stopped by a signal, the checkpoint of the last epoch is untouched") from None
    print(
        f"{stop}: saved in {log.checkpoint}; to continue from this step, run the same command with --auto-resume (or "
        f"--resume {log.checkpoint})",
        flush=True,
    )


def resume_from(checkpoint: Path | None, model, training, epochs: int) -> tuple[int, float]:
    """(the first epoch to train, the best validation accuracy so far): from `checkpoint` when the plan resumes
    one (saying so), else (0, -1). A checkpoint of a step sets `training.midway`: the epoch continues there."""
    if checkpoint is None:
        return 0, -1.0
    state = load_checkpoint(checkpoint)
    start_epoch, best_acc = restore(state, model, training, checkpoint)
    training.midway = Midway.of(state)
    at_step = f", step {training.midway.step}" if training.midway is not None else ""
    print_once(
        f"Resuming from {checkpoint}: epoch {start_epoch}{at_step} of {epochs}, best val acc so far {best_acc:.3f}"
    )
    return start_epoch, best_acc
