"""Scoring in every process (predict.py, evaluate.py), rank 0 gathering each image once, in order, at any world size."""

import argparse
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataset.images import SKIPPED, image_problem
from inference.results import Row
from inference.trained import TrainedModel
from multi_train_utils.bookkeeping import Tally, ToHost, progress_bar
from multi_train_utils.distributed_utils import Process, init_distributed_mode, launcher_environment, single_process
from multi_train_utils.spawn_utils import spawn_world_size
from utils import UserError, positive_int

UNKNOWN = -1  # the label of an image whose true class is not known (predict.py's)


def add_scoring_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tta", action="store_true", help="test-time augmentation: each image's probabilities averaged "
                   "with its mirror image's (twice the work)")  # fmt: skip
    p.add_argument("--world-size", type=positive_int, help="start this many processes with torch.multiprocessing."
                   "spawn, each scoring its share of the images (under torchrun, leave it out: --nproc_per_node says "
                   "how many)")  # fmt: skip


def join_group(device: str | None, rank: int | None = None, world_size: int | None = None) -> Process:
    """This process's place: spawn's `rank` of `world_size`, torchrun's, or alone, in no group (mps works there)."""
    if rank is None and launcher_environment() is None:
        return single_process(device)
    return init_distributed_mode(device, rank=rank, world_size=world_size)


def spawned_world_size(requested: int, device: str | None) -> int:
    """--world-size, checked against the GPUs (spawn_world_size); refused under torchrun, which started them."""
    if launcher_environment() is not None:
        raise UserError("--world-size starts processes with spawn; under torchrun, --nproc_per_node says how many")
    return spawn_world_size(requested, device)


@dataclass
class ScoredBatch:
    """Consecutive images from `start`: their probabilities (float32, on the host), and whether each could be read."""

    start: int
    probabilities: torch.Tensor
    readable: list[bool]


def scored_batches(trained: TrainedModel, loader, count: int, world_size: int, tta=False, tally: Tally | None = None,
                   progress=None):  # fmt: skip
    """On rank 0, the ScoredBatch of all `count` images in their order (docs/trained-models.md); the others score their
    shards (val_shard's), yielding nothing; `tally` counts this process's. Each reaches the host as the next runs."""
    device, batch_size = trained.device, loader.batch_size
    steps = math.ceil(math.ceil(count / world_size) / batch_size)  # rank 0's batches: its shard is the longest
    batches, on_the_way = iter(loader), None
    for step in progress_bar(range(steps), progress, leave=False) if progress else range(steps):
        images, labels = next(batches, (None, None))
        if images is None:  # this shard has ended; the others' have not
            scores = torch.empty(0, len(trained.classes), device=device)
            labels = torch.empty(0, dtype=torch.long, device=device)
        else:
            scores = log_probabilities(trained, images, tta)
            labels = labels.to(device, non_blocking=device.type == "cuda")
        if tally is not None:
            tally.add(scores, labels)  # log-probabilities rank the classes as the logits do
        gathered = gathered_in_order(scores.exp(), labels != SKIPPED, batch_size, world_size)
        if gathered is None:
            continue
        start = step * world_size * batch_size
        if on_the_way is not None:
            yield scored(*on_the_way)
        on_the_way = start, ToHost(gathered[: count - start])
    if on_the_way is not None:
        yield scored(*on_the_way)


def log_probabilities(trained: TrainedModel, images: torch.Tensor, tta: bool) -> torch.Tensor:
    """A batch's class log-probabilities (float32, on the device); with `tta`, of its and its mirror's mean."""
    choice, device, model = trained.choice, trained.device, trained.model
    batch = choice.batch_to(images, device)  # 8-bit on the way, normalised on the device
    with choice.autocast(device):
        logits = model(batch)
        mirrored = model(choice.batch_to(batch.flip(-1), device)) if tta else None  # batch_to: keep the layout
    scores = logits.float().log_softmax(dim=1)
    if tta:  # log((p + q) / 2), without taking p and q out of logarithms, where small ones would round to 0
        scores = torch.logaddexp(scores, mirrored.float().log_softmax(dim=1)) - math.log(2)
    return scores


def gathered_in_order(probabilities: torch.Tensor, readable: torch.Tensor, batch_size: int, world_size: int):
    """Rank 0: every batch as rows [probabilities, readable] in image order, each padded to batch_size; else None."""
    payload = torch.zeros(batch_size, probabilities.shape[1] + 1, device=probabilities.device)
    payload[: len(probabilities), :-1] = probabilities
    payload[: len(probabilities), -1] = readable
    if world_size == 1:
        return payload
    parts = [torch.empty_like(payload) for _ in range(world_size)] if dist.get_rank() == 0 else None
    dist.gather(payload, parts, dst=0)
    return None if parts is None else torch.stack(parts, dim=1).flatten(0, 1)  # j by j, rank by rank


def scored(start: int, on_the_way: ToHost) -> ScoredBatch:
    rows = on_the_way.arrived()
    return ScoredBatch(start, rows[:, :-1], rows[:, -1].bool().tolist())


def rows_of(batch: ScoredBatch, images: list, labels: list[int], classes: list[str], topk: int) -> list[Row]:
    """The results rows of a scored batch; an unreadable image is decoded again here, on rank 0, to say why."""
    top = batch.probabilities.topk(topk, dim=1)
    rows = []
    for offset, (values, indices) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
        path, label = images[batch.start + offset], labels[batch.start + offset]
        true_class = None if label == UNKNOWN else classes[label]
        if batch.readable[offset]:
            rows.append(Row(str(path), true_class, [(classes[c], p) for c, p in zip(indices, values, strict=True)]))
        else:
            rows.append(Row(str(path), true_class, [], image_problem(path) or "could not be read"))
    return rows
