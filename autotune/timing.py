"""What auto times (autotune/choose.py decides from it): train_one_epoch's steps of the run's model in each way of
computing, the largest micro-batch that fits a GPU, one loader worker's images, and batches made on the device."""

import contextlib
import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from dataset.on_device import TrainingBatches
from dataset.sampling import sample_seeds
from multi_train_utils.distributed_utils import shuffled_batches
from multi_train_utils.memory import OutOfMemory, largest_that_fits, pass_fits
from multi_train_utils.train_eval_utils import Choice, Training, train_one_epoch
from my_dataset import loaders
from network.architectures import create_model, freeze_all_but_head
from network.checkpointing import enable_grad_checkpointing
from utils import UserError

MAX_ROUNDS = 3  # timed samples per candidate, taken in turns: the fastest of them counts
MEASURE_SHARE = 0.05  # more than one round only while the measuring stays within this share of the run's training
SAMPLE_SECONDS = 0.05  # a timed sample is at least this long (several steps where a step is quicker)
LOAD_IMAGES = 16  # training images loaded to time loading in this process (after one untimed)
LOADER_BATCHES = 3  # batches a loader worker delivers to time it (after its first)


@dataclass
class Measured:
    """Each candidate's images per second, the micro-batch search's lines, seconds per image (None: not timed)."""

    speeds: dict
    lines: list
    load: float | None = None
    making: float | None = None


def measure(config, plan, device: torch.device, train_set, candidates: list[Choice], todo: dict) -> Measured:
    """Time what choose.py's `todo` asks for, leaving the run's random state as it was."""
    micro_batch, lines = todo["given_micro_batch"], []
    if todo["micro_batch"]:
        micro_batch, lines = fitting_micro_batch(config, plan, device, candidates[0], todo["held"], todo["world_size"])
        micro_batch = micro_batch or todo["given_micro_batch"]
    candidates = [replace(candidate, micro_batch=micro_batch) for candidate in candidates]
    try:
        seconds = time_candidates(candidates, config, plan, device, todo["world_size"])
    except torch.OutOfMemoryError:  # a --micro-batch given by hand (auto's was found to fit)
        raise OutOfMemory(
            f"--micro-batch {config.micro_batch} does not fit in the memory of {config.model} at {config.img_size} "
            f"px on {device}: give a smaller one, or leave it to auto"
        ) from None
    measured = Measured({candidate: 1 / seconds[candidate] for candidate in candidates}, lines)
    fastest = max(measured.speeds, key=measured.speeds.get)
    if todo["workers"] or todo["where"]:
        measured.load = time_loading(train_set, config, device)
    if todo["where"]:
        measured.making = device_seconds_per_image(train_set, config.batch_size, device, fastest.memory_format)
    return measured


def time_candidates(candidates: list[Choice], config, plan, device: torch.device, world_size: int = 1) -> dict:
    """Seconds per image of the run's model's steps in each candidate (take_turns), its random state left alone."""
    classes = len(plan.split.classes)
    images = config.epochs * len(plan.split.train_images) / world_size  # what this process will train
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = measured_model(config, classes, device)
        steps = stepper(model, config.batch_size, config.img_size, classes, device)
        best = take_turns(steps, candidates, 1 if device.type == "cpu" else 2, images / config.batch_size)
    del model, steps
    if device.type == "cuda":  # the run's own memory figures should not include the measuring
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {candidate: seconds / config.batch_size for candidate, seconds in best.items()}


def take_turns(steps, candidates: list[Choice], warm_up: int, run_steps: float) -> dict:
    """The fastest step of each candidate in seconds, timed in turns (docs/performance.md, Machines)."""
    start = time.perf_counter()
    warmed = {candidate: [steps(candidate, 1) for _ in range(warm_up)][-1] for candidate in candidates}
    count = {candidate: max(1, math.ceil(SAMPLE_SECONDS / seconds)) for candidate, seconds in warmed.items()}
    best = {candidate: math.inf for candidate in candidates}
    for _ in range(MAX_ROUNDS):
        round_start = time.perf_counter()
        for candidate in candidates:
            best[candidate] = min(best[candidate], steps(candidate, count[candidate]) / count[candidate])
        now = time.perf_counter()
        if now - start + (now - round_start) > MEASURE_SHARE * run_steps * min(best.values()):
            break
    return best


def stepper(model, batch_size: int, img_size: int, classes: int, device: torch.device):
    """steps(candidate, count): the seconds `count` steps of train_one_epoch take in `candidate`."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=generator).to(device)
    labels = torch.randint(0, classes, (batch_size,), generator=generator)  # on the host, as a loader gives them
    # plain SGD: any optimizer costs every candidate alike, and momentum would keep the first one's layout
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def steps(candidate: Choice, count: int) -> float:
        model.to(memory_format=candidate.memory_format)  # in place
        batch = candidate.batch_to(images, device)
        training = Training(model, optimizer, choice=candidate, scaler=candidate.grad_scaler(device))
        synchronize(device)
        start = time.perf_counter()
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # (its progress bar)
            train_one_epoch(training, [(batch, labels)] * count, device, epoch=0)  # ends with the device done
        return time.perf_counter() - start

    return steps


def measured_model(config, classes: int, device: torch.device):
    """A model such as the run trains (not its weights): the caller keeps the run's random state."""
    model = create_model(classes, config.model)
    if config.freeze_layers:
        freeze_all_but_head(model, config.model)
    if config.grad_checkpointing:  # its memory and its time: each block computed twice
        enable_grad_checkpointing(model, config.model)
    return model.to(device).train()


def fitting_micro_batch(config, plan, device: torch.device, hungriest: Choice, held: int = 0, world_size: int = 1):
    """(the largest micro-batch that fits `device`, None for the whole batch; its lines), beside what training holds."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = measured_model(config, len(plan.split.classes), device).to(memory_format=hungriest.memory_format)
        copies = (2 if config.opt == "adamw" else 1) + (world_size > 1)  # the optimizer's moments, DDP's buckets
        reserve = copies * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) + held
        images = torch.randn(config.batch_size, 3, config.img_size, config.img_size, device=device)
        images = images.contiguous(memory_format=hungriest.memory_format)
        size = largest_that_fits(lambda m: pass_fits(model, hungriest, images[:m], reserve, train=True), len(images))
    where = f"{config.model} at {config.img_size} px on {device}"
    if size == 0:
        raise UserError(f"not even one image fits in the memory of {where}: a smaller --img-size, "
                        "--grad-checkpointing, or a device with more memory")  # fmt: skip
    if size == config.batch_size:
        return None, [f"Auto: the whole batch of {size} images fits in the memory of {where}"]
    return size, [
        f"Auto: micro-batches of {size} images, the most that fit in the memory of {where}: each step sums "
        f"the gradients of {math.ceil(config.batch_size / size)} of them (--batch-size {config.batch_size} unchanged)"
    ]


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it (the CPU computes as it is asked)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_loading(train_set, config, device: torch.device) -> float:
    """Seconds per image one loader worker delivers after its first batch (too few batches: one core's, here)."""
    batches = shuffled_batches(train_set, config.batch_size, seed=0)
    if len(batches) < LOADER_BATCHES + 1:  # one core's, as a worker loads (one thread)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train_set[(0, 0)]  # untimed: it imports image plug-ins
            count = min(LOAD_IMAGES, len(train_set))
            start = time.perf_counter()
            for index in range(count):
                train_set[(index, index)]  # (index, augmentation seed), as the loader asks
            return (time.perf_counter() - start) / count
        finally:
            torch.set_num_threads(threads)
    loader = loaders(train_set, train_set, batches, [], config, Choice(workers=1), device)[0]
    loaded = iter(loader)
    next(loaded)  # the worker starts, and loads its first batch
    start = time.perf_counter()
    for _ in range(LOADER_BATCHES):
        next(loaded)
    seconds = time.perf_counter() - start
    del loaded, loader  # the worker stops
    return seconds / (LOADER_BATCHES * config.batch_size)


def device_seconds_per_image(train_set, batch_size: int, device: torch.device, memory_format) -> float:
    """Seconds per image it takes to make a training batch of the first images on `device`, gathered from the store
    and copied there (as a stream does, ahead of the step: an upper bound of what the step waits for)."""
    batches = TrainingBatches(train_set, [], device, memory_format, streamed=True)
    index = np.resize(np.arange(min(batch_size, len(train_set))), batch_size)
    seeds = sample_seeds(0, 0, index)

    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        batches.make(index, seeds)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:]) / batch_size  # the first untimed
