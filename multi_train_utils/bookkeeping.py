"""What train_one_epoch and evaluate track besides the step: sums over every rank checked a step behind, tallies."""

import math
import sys
import time

import torch
from tqdm import tqdm

from dataset.images import SKIPPED
from dataset.sampling import step_seed
from multi_train_utils.distributed_utils import all_reduce_in_background, get_rank, is_main_process, reduce_value
from multi_train_utils.stop_and_resume import StopRequested, agreed_signal, stop_votes
from utils import UserError


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite: raised on every rank at the same step, a step late, before anything is saved."""


def progress_bar(batches, description: str, **options) -> tqdm:
    """tqdm over `batches`, drawn by the main process alone."""
    return tqdm(batches, desc=description, file=sys.stdout, disable=not is_main_process(), **options)


class EpochBooks:
    """An epoch's books: its sums over every rank, checked a step behind; its optimizer steps; where a resume goes."""

    def __init__(self, training, data_loader, device: torch.device, epoch: int, max_skipped=None):
        self.training, self.data_loader, self.device, self.epoch = training, data_loader, device, epoch
        self.max_skipped, self.first_lr, self.started = max_skipped, training.epoch_lr(), training.epoch_start()
        self.midway, training.midway = training.midway, None
        self.totals = [0.0, 0.0, 0.0] if self.midway is None else self.midway.totals
        self.scaler = training.scaler or torch.amp.GradScaler(device.type, enabled=False)
        self.stopping, self.pending, self.progress = None, None, None

    def steps(self):
        """(step, batch) from where a resumed epoch stopped."""
        start = 0 if self.midway is None else self.midway.step
        if self.midway is not None:
            self.data_loader.batch_sampler.start_at(start)  # a SeededBatchSampler's next pass starts there
        self.progress = progress_bar(self.data_loader, f"[epoch {self.epoch}] train", initial=start)
        for step, batch in enumerate(self.progress, start=start):
            self.seed_random_draws(step)
            yield step, batch

    def seed_random_draws(self, step: int) -> None:
        """Seed the CPU's and device's generators from (seed, epoch, step, rank): a resume draws what the run drew."""
        seed = step_seed(self.training.objective.seed, self.epoch, step, get_rank())
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device's: this process's (set_device)
        elif self.device.type == "mps":
            torch.mps.manual_seed(seed)

    def last_of_group(self, step: int) -> bool:
        return (step + 1) % self.training.accumulate == 0 or step + 1 == len(self.data_loader)

    def group_size(self, step: int) -> int:
        """The batches in the optimizer step of batch `step`: training.accumulate, or at the epoch's end those left."""
        accumulate, batches = self.training.accumulate, len(self.data_loader)
        return min(accumulate, batches - step // accumulate * accumulate)

    def check(self, step: int, loss_sum: torch.Tensor, read: int, images: int) -> None:
        """Send this step's sums; check the last one's, and this one's before the last or a stopping optimizer step."""
        sent = StepTotals(loss_sum, [read, images - read, *stop_votes()], self.device)
        if self.pending is not None:
            self.add(self.pending)
        self.pending = sent
        if self.last_of_group(step) and (self.stopping is not None or step + 1 == len(self.data_loader)):
            self.add(self.pending)
            self.pending = None
        # the mean as checked so far; drawn when the bar next redraws (tqdm's pace, not every step)
        self.progress.set_postfix(mean_loss=f"{self.totals[0] / max(self.totals[1], 1):.3f}", refresh=False)

    def add(self, sent: "StepTotals") -> None:
        """Add a step's sums and any stop signal; a non-finite loss or too many skipped images stop every rank alike."""
        step_totals = sent.get()
        if not math.isfinite(step_totals[0]):
            raise NonFiniteLossError(f"non-finite loss at epoch {self.epoch}: stopped, the last checkpoint is from "
                                     "before this epoch; check the data")  # fmt: skip
        self.totals = [total + new for total, new in zip(self.totals, step_totals[:3], strict=True)]
        if self.max_skipped is not None and self.totals[2] > self.max_skipped:
            skipped, of_what = int(self.totals[2]), f"epoch {self.epoch}'s training images"
            raise UserError(too_many_skipped(skipped, self.max_skipped, of_what))
        self.stopping = agreed_signal(step_totals[3:]) or self.stopping

    def stop_if_asked(self, step: int) -> None:
        """After the optimizer step that ends batch `step`: StopRequested on every rank if a stop signal reached any."""
        if self.stopping is not None:
            self.progress.close()
            seconds = time.perf_counter() - self.started
            raise StopRequested(self.stopping, self.epoch, step + 1, self.totals, self.first_lr, seconds)

    def result(self) -> tuple[float, int]:
        total_loss, total_images, _ = self.totals
        return total_loss / max(total_images, 1), int(total_images)


def count_readable(labels: torch.Tensor) -> int:
    """The batch's readable images (not labelled SKIPPED), counted on the host before the labels go to the device."""
    return sum(label != SKIPPED for label in labels.tolist())


class StepTotals:
    """A step's sums (loss, read, skipped, stop votes) over the ranks, to the host: `get` waits for them alone."""

    def __init__(self, loss_sum: torch.Tensor, counts: list, device: torch.device):
        counts = torch.tensor(counts, dtype=torch.float64).to(device, non_blocking=True)
        values = torch.cat([loss_sum.detach().double().reshape(1), counts])
        self.work = all_reduce_in_background(values)
        if device.type == "cuda" and self.work is not None:
            self.work.wait()  # on a GPU: the copy to the host waits for the all-reduce on the device, not the host
            self.work = None
        self.values = ToHost(values)

    def get(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
        return self.values.arrived().tolist()


class ToHost:
    """A tensor on its way to the host: from a GPU, a copy queued behind its device's work (`arrived` waits for it)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.ready = tensor, None
        if tensor.device.type == "cuda":
            self.tensor = tensor.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensor.device))  # the stream of its GPU, whichever it is

    def arrived(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor


class Tally:
    """evaluate's counts, on the device: the readable images' confusion matrix, and how many are in their top k."""

    def __init__(self, num_classes: int, device: torch.device, topk: int | None = None):
        self.num_classes, self.topk = num_classes, topk
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        self.in_topk = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch: each image adds 1 (0 if skipped) at its cell; a mask or bincount would make the host wait."""
        read = (labels != SKIPPED).long()
        cells = labels.clamp(min=0) * self.num_classes + logits.argmax(dim=1)
        self.confusion.view(-1).index_add_(0, cells, read)
        if self.topk is not None:
            in_topk = (logits.topk(self.topk, dim=1).indices == labels[:, None]).any(dim=1)
            self.in_topk += (in_topk.long() * read).sum()

    def over_all_ranks(self, data_loader, max_skipped=None) -> torch.Tensor | tuple[torch.Tensor, int]:
        """The confusion matrix (and top-k count) over every rank; more than `max_skipped` unreadable stop all ranks."""
        counts = torch.cat([self.confusion.view(-1), self.in_topk.view(1)])
        counts = reduce_value(counts, average=False).cpu()
        confusion, in_topk = counts[:-1].view(self.num_classes, self.num_classes), int(counts[-1])
        skipped = max_skipped is not None and len(data_loader.dataset) - int(confusion.sum())
        if skipped and skipped > max_skipped:  # the same on every rank: the matrix is the sum over all of them
            raise UserError(too_many_skipped(skipped, max_skipped, "the validation images"))
        return confusion if self.topk is None else (confusion, in_topk)


def too_many_skipped(skipped: int, limit: int, of_what: str) -> str:
    if limit == 0:
        return f"an image of {of_what} could not be read (--strict-images): stopped; the warning above names it"
    return (f"{skipped} of {of_what} could not be read, more than the {limit} (1 %) a run skips: stopped; the "
            "warnings above name them (the last checkpoint is from before this epoch)")  # fmt: skip


def unreadable_limits(train_images: int, val_images: int, strict: bool) -> tuple[int, int]:
    """How many training and validation images an epoch may skip: 1 % (at least one), or none with --strict-images."""
    return tuple(0 if strict else max(1, count // 100) for count in (train_images, val_images))
