"""What a run writes: its record files, and each epoch's line, metrics, TensorBoard figures, weights, checkpoint and
tracked epoch (RunLog). In DDP rank 0 alone writes."""

import contextlib
import time

from dataset.folders import split_fingerprint, write_class_indices
from multi_train_utils.bookkeeping import NonFiniteLossError
from multi_train_utils.checkpoint import CHECKPOINT_NAME, save_epoch, training_state
from multi_train_utils.epoch_writer import EpochWriter, on_host
from multi_train_utils.memory import OutOfMemory
from run.metrics import METRICS_NAME, append_metrics, keep_metrics_before, read_metrics, skipped_note
from run.tensorboard import Board
from run.tracking import Tracking
from utils import OutputError, write_json


class RunLog:
    """A run's files in `plan.output_dir` for the epochs from `start_epoch` on (later lines, trained again, are
    dropped), and the best accuracy so far. Disabled (every rank but 0 in DDP), it writes nothing."""

    def __init__(self, config, plan, process, choice, preview_set, start_epoch, best_acc, enabled=True):
        self.enabled, self.output_dir, self.classes = enabled, plan.output_dir, plan.split.classes
        self.choice, self.world_size, self.save_every = choice, process.world_size, config.save_every
        self.best_acc, self.checkpoint = best_acc, plan.output_dir / CHECKPOINT_NAME
        self.writer, self.writing = EpochWriter(), -1  # the epoch whose files are being written in the background
        self.record = config.record(
            data_path=plan.data_path, weights=plan.weights, resume=plan.resume, output_dir=plan.output_dir,
            world_size=process.world_size, device=str(process.device), channels_last=choice.channels_last,
            amp=choice.amp,  # what auto chose, so that predict.py and evaluate.py compute as the run did
            micro_batch=choice.micro_batch,  # what auto chose; where it made batches, as the flag (held or streamed:
            batches="device" if choice.on_device else choice.batches,  # as the device's room says at each start)
            split=split_fingerprint(plan.split, plan.data_path),  # a resume checks it has the same images
            **plan.given,  # the run's --batch-size and --lr as given, and for how many processes
        )  # fmt: skip
        if enabled:
            write_class_indices(self.classes, self.output_dir)
            if start_epoch > 0:
                keep_metrics_before(self.output_dir / METRICS_NAME, start_epoch)
            logged = read_metrics(self.output_dir / METRICS_NAME)
            print(f'Output: {self.output_dir}  (TensorBoard: tensorboard --logdir "{self.output_dir / "tb"}")',
                  flush=True)  # fmt: skip
            write_json(self.output_dir / "args.json", self.record)
            self.board = Board(self.output_dir / "tb", self.record, preview_set, start_epoch)
        self.tracking = Tracking(config, plan, self.record, process.device, enabled)
        if enabled:
            self.tracking.start(logged, start_epoch)

    def training_state(self, epoch: int, model, training) -> dict:
        """The checkpoint after `epoch` of `model` (unwrapped) and `training` (its tracked run added later)."""
        return training_state(epoch, model, training, self.best_acc, self.classes, self.world_size, self.record)

    def epoch(self, metrics: dict, model, training, best, best_acc: float) -> None:
        """Everything an epoch leaves: its line now; its files, from a copy taken now, in the background while the next
        epoch trains (multi_train_utils/epoch_writer.py), `best` (the network that improved, or None) as best.pth;
        then the tracked epoch. Times the loop's holds for it: logging (the preview's predictions) and saving."""
        epoch, self.best_acc = metrics["epoch"], best_acc
        started = time.perf_counter()
        self.wait_for_writes()  # the last epoch's files, written meanwhile: a failure to write them stops here
        state = self.training_state(epoch, model, training)
        waited = time.perf_counter() - started
        started = time.perf_counter()
        predicted = self.board.predictions(model, self.choice)  # the preview's, with this epoch's weights
        logging = time.perf_counter() - started
        started = time.perf_counter()
        keep = self.save_every > 0 and (epoch + 1) % self.save_every == 0
        best = None if best is None else "model" if best is model else "ema"  # the state's part best.pth links
        state, arrived = on_host(state)
        line = metrics | {"logging_seconds": logging, "saving_seconds": waited + time.perf_counter() - started}
        self.print_epoch(line)

        def write() -> None:
            arrived()
            self.board.epoch(line, best_acc, predicted, self.classes)
            append_metrics(self.output_dir / METRICS_NAME, line)
            state.update(self.tracking.checkpoint_entry())  # once the tracker has named the run (a new one's)
            save_epoch(self.output_dir, epoch, state, best, keep=keep)

        self.writing = epoch
        self.writer.write(write, after=lambda: self.tracking.epoch(line))  # the tracker: once it is on disk

    def wait_for_writes(self) -> None:
        """Wait until the epoch's files being written are on disk; a failure to write them stops the run here."""
        try:
            self.writer.wait()
        except OutputError as error:
            raise self.stopped(error, self.writing) from None

    def stopped(self, error: OutputError, epoch: int) -> OutputError:
        """The line that stops the run where epoch `epoch`'s files could not be written."""
        last = self.checkpoint  # each finished epoch wrote one: the epoch before's, when `epoch`'s failed
        kept = f"{last} (epoch {epoch - 1}) is untouched" if last.exists() else f"{self.output_dir} holds no checkpoint"
        return OutputError(f"{error}; stopped, {kept}: once {self.output_dir} can be written, {self.continuing()}")

    def continuing(self) -> str:
        """The command that continues the run: from its checkpoint, or anew where it saved none (run/plan.py)."""
        return f"run the same command with --auto-resume --output-dir {self.output_dir}"

    @contextlib.contextmanager
    def ending(self):
        """Around the epochs: marks how the tracked run ends, waits for the files being written (their failure
        raised only where the epochs ended well: another exception's traceback is the story), and ends the line of
        an error that stops the run with the command that goes on from there."""
        with self.tracking.marks_how_the_run_ends():
            try:
                yield
            except BaseException as error:
                with contextlib.suppress(OutputError):
                    self.wait_for_writes()
                if isinstance(error, OutOfMemory):  # --micro-batch is a speed flag: the run goes on with it
                    raise OutOfMemory(f"{error}; then {self.continuing()} and that flag") from None
                if isinstance(error, KeyboardInterrupt):
                    saved = f"{self.checkpoint} is whole" if self.checkpoint.exists() else "no checkpoint saved yet"
                    raise KeyboardInterrupt(f"{saved}; to go on, {self.continuing()}") from None
                if isinstance(error, NonFiniteLossError):  # another --lr: another recipe, so a new run
                    last = self.output_dir / "weights" / "last.pth"
                    start = f", from --weights {last} into another --output-dir" if last.exists() else ""
                    raise NonFiniteLossError(f"{error}; or start a new run with a lower --lr{start}") from None
                raise
            self.wait_for_writes()  # the epochs ended well: the last one's files on disk before the run ends

    def done(self, best_acc: float) -> None:
        if self.enabled:
            self.board.close()
            self.tracking.end("FINISHED")
            print(f"Done: best val acc {best_acc:.3f}; weights in {self.output_dir / 'weights'}", flush=True)

    def print_epoch(self, metrics: dict) -> None:
        """The epoch's line: its loss, accuracy, rate, and where its time went."""
        if not self.enabled:
            return
        parts = (metrics["train_seconds"], metrics["validation_seconds"], metrics["logging_seconds"])
        print(
            f"[epoch {metrics['epoch']}] train loss {metrics['train_loss']:.3f}  val acc {metrics['val_acc']:.3f} "
            f"({metrics['val_correct']}/{metrics['val_total']})  lr {metrics['lr']:.2e}  "
            f"{metrics['epoch_seconds']:.1f} s (training {parts[0]:.2f}, validation {parts[1]:.2f}; then logging "
            f"{parts[2]:.2f}, saving {metrics['saving_seconds']:.2f}), {metrics['train_images_per_sec']:.1f} img/s"
            + skipped_note(metrics),
            flush=True,
        )
