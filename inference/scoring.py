"""Scoring images with a trained model in every process of a job, as predict.py and evaluate.py do: each process
scores its shard (val_shard), and rank 0 gathers each batch from all of them in the order of the images, so that it
sees every image once, in input order, whatever the world size.
"""

import argparse
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dataset.images import SKIPPED, image_problem
from inference.results import Row
from inference.trained import TrainedModel
from multi_train_utils.bookkeeping import Tally, ToHost, progress_bar
from multi_train_utils.distributed_utils import (
    Process,
    get_rank,
    init_distributed_mode,
    launcher_environment,
    single_process,
)
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
    """This process's place in the job: spawn passes `rank` and `world_size`, torchrun sets them in the environment.
    Started alone with plain python it forms no group: no one to gather from, and no backend serves a Mac's GPU."""
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


def scored_batches(
    trained: TrainedModel, loader, count: int, world_size: int, tta=False, tally: Tally | None = None, progress=None
):
    """On rank 0, the ScoredBatch of all `count` images in their order (why: docs/trained-models.md); the other ranks
    score their shards (`loader`: val_shard's) for it and yield nothing. With `tally`, this process's batches are
    counted in it too. A gathered batch travels to the host while the next one computes."""
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
    """A batch's class log-probabilities (float32, on the device) in the run's precision and layout; with `tta`,
    those of the mean of each image's and its mirror image's probabilities."""
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
    """On rank 0, every process's batch as rows of [probabilities, readable] in the order of the images
    (scored_batches); None on the other ranks. Each is padded to batch_size rows: gather takes one size."""
    payload = torch.zeros(batch_size, probabilities.shape[1] + 1, device=probabilities.device)
    payload[: len(probabilities), :-1] = probabilities
    payload[: len(probabilities), -1] = readable
    if world_size == 1:
        return payload
    parts = [torch.empty_like(payload) for _ in range(world_size)] if get_rank() == 0 else None
    dist.gather(payload, parts, dst=0)
    return None if parts is None else torch.stack(parts, dim=1).flatten(0, 1)  # j by j, rank by rank


def scored(start: int, on_the_way: ToHost) -> ScoredBatch:
    rows = on_the_way.arrived()
    return ScoredBatch(start, rows[:, :-1], rows[:, -1].bool().tolist())


def rows_of(batch: ScoredBatch, images: list, labels: list[int], classes: list[str], topk: int) -> list[Row]:
    """The results rows of a scored batch; an unreadable image is decoded again here, on rank 0, to say why (the
    process whose shard it was only marked it)."""
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
