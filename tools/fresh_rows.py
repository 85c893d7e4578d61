"""The benchmark's rows without a script, each in a fresh process (none inheriting another's caches, memory or
threads): model only, the training loader alone, peer-style (docs/performance.md, "What the rows measure")."""

import itertools
import math
import multiprocessing
import os
import sys
import time
from dataclasses import replace
from queue import Empty

import torch
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from autotune.timing import synchronize
from dataset.transforms import IMAGENET_MEAN, IMAGENET_STD
from model import initial_model
from multi_train_utils.distributed_utils import shuffled_batches, single_process
from multi_train_utils.train_eval_utils import Choice, Training, evaluate, train_one_epoch
from my_dataset import datasets, loaders
from recipe.optimizer import build_optimizer
from run.metrics import peak_memory
from tools.compute_peak import row, trained_row, worker_phrase
from utils import UserError

UNTIMED_STEPS = 3  # allocations, kernel choices, compilation


def fresh_rows(args, config, plan, choice: Choice, peaks: dict, flops: float):
    """In this order: train_one_epoch over one batch on the device, as auto chose (the ceiling), in float32 NCHW and
    compiled; the training loader alone, with 1 worker and with the scripts' workers (at least 1); peer-style."""
    cases = [("model only (the ceiling)", "model-only", choice, False),
             ("model only, float32 NCHW", "model-only", replace(choice, amp="off", channels_last=False), False),
             ("model only, torch.compile", "compile", choice, True)]  # fmt: skip
    for name, kind, case, compiled in cases:
        if kind in args.rows:
            measured = in_fresh_process(name, _model_only, config, case, compiled, args.steps)
            yield trained_row(name, kind, 1, case, measured, peaks, flops)
    theirs = f"loader, {worker_phrase(choice.workers)} (as the training scripts)"
    if choice.workers == 0:
        theirs = "loader, 1 worker (the training scripts here: none, images loaded between steps)"
    start_method = multiprocessing.get_start_method()  # what a script's loader gets: the platform's default
    for count, name in ((1, "loader, 1 worker"), (max(1, choice.workers), theirs)) if "loader" in args.rows else ():
        measured = in_fresh_process(name, _loader, config, plan, count, args.loader_images, start_method)
        measured["img_per_sec_per_worker"] = measured["img_per_sec"] / count
        yield row(name, "loader", 1, "–", measured)
    if "peer" in args.rows:
        measured = in_fresh_process("peer", _peer, config, plan, choice, args.epochs)
        name = f"peer-style: ImageFolder, PIL, {worker_phrase(measured['workers'])}, pinned"
        yield trained_row(name, "peer", 1, choice, measured, peaks, flops)


def _model_only(queue, config, choice: Choice, compiled: bool, steps: int) -> None:
    """Images per second of `steps` steps over one batch on the device, after UNTIMED_STEPS."""
    sys.stdout = open(os.devnull, "w")  # train_one_epoch's progress bar
    device = single_process(config.device).device
    training = training_for(config, choice, device, classes=5, batches_per_epoch=1, compiled=compiled)
    shape, generator = (config.batch_size, 3, config.img_size, config.img_size), torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)  # as a loader gives them
    batch = choice.batch_to(pixels, device), torch.randint(0, 5, (config.batch_size,))

    def seconds(count: int) -> float:
        start = time.perf_counter()
        train_one_epoch(training, [batch] * count, device, epoch=0)
        synchronize(device)
        return time.perf_counter() - start

    first = seconds(1)
    seconds(UNTIMED_STEPS - 1)
    timed = seconds(steps)
    compiling = {"compile_seconds": first - timed / steps} if compiled else {}
    queue.put({"img_per_sec": steps * config.batch_size / timed, **compiling, **peak_memory(device)})


def training_for(config, choice: Choice, device, classes: int, batches_per_epoch: int, compiled=False) -> Training:
    """The scripts' model and optimizer at their default settings, computing as `choice` says."""
    model = initial_model(config.model, classes, device, choice.memory_format)
    optimizer, _ = build_optimizer(model, config, batches_per_epoch)
    trained = torch.compile(model) if compiled else model
    return Training(trained, optimizer, choice=choice, scaler=choice.grad_scaler(device))


def _loader(queue, config, plan, workers: int, images: int, start_method: str) -> None:
    """Images per second of the scripts' training loader, over at least `images` images in whole rounds of `workers`
    batches (the workers deliver in turn), after the workers' start."""
    multiprocessing.set_start_method(start_method, force=True)
    device = torch.device(config.device)
    train_set, val_set = datasets(plan, config)
    batches = shuffled_batches(train_set, config.batch_size, config.seed)
    train_loader, _ = loaders(train_set, val_set, batches, range(len(val_set)), config, Choice(workers=workers), device)
    batches = batches_over_epochs(train_loader)
    for _ in range(max(2, workers)):
        next(batches)
    rounds = math.ceil(math.ceil(images / config.batch_size) / workers)
    start = time.perf_counter()
    loaded = sum(len(next(batches)[1]) for _ in range(rounds * workers))
    seconds, cpu = time.perf_counter() - start, peak_memory(torch.device("cpu"))
    queue.put({"img_per_sec": loaded / seconds, "workers": workers, "stored": plan.store is not None, **cpu})


def batches_over_epochs(loader):
    """The loader's batches, epoch after epoch without end, each shuffled as in training."""
    for epoch in itertools.count():
        loader.batch_sampler.set_epoch(epoch)
        yield from loader


def _peer(queue, config, plan, choice: Choice, epochs: int) -> None:
    """A whole run as torchvision's references make one; img/s of the epochs after the first, run_seconds of all."""
    started = time.perf_counter()
    sys.stdout = open(os.devnull, "w")  # train_one_epoch's progress bar
    device = single_process(config.device).device
    augment = T.Compose([T.RandomResizedCrop(config.img_size), T.RandomHorizontalFlip(), T.ToTensor(),
                         T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])  # fmt: skip
    resize = T.Compose([T.Resize(config.img_size * 256 // 224), T.CenterCrop(config.img_size), T.ToTensor(),
                        T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pin = device.type == "cuda"
    train_set = image_folder(plan.data_path, augment, plan.split.train_images)
    val_set = image_folder(plan.data_path, resize, plan.split.val_images)
    loader = DataLoader(train_set, config.batch_size, shuffle=True, num_workers=cores, drop_last=True,
                        pin_memory=pin, persistent_workers=True)  # fmt: skip
    val_loader = DataLoader(val_set, config.batch_size, num_workers=cores, pin_memory=pin, persistent_workers=True)
    training = training_for(config, choice, device, len(train_set.classes), len(loader))
    images_seen, seconds, out = 0, 0.0, plan.output_dir / "runs" / "peer"
    out.mkdir(parents=True, exist_ok=True)
    for epoch in range(epochs):
        start = time.perf_counter()
        _, images = train_one_epoch(training, loader, device, epoch)
        synchronize(device)
        images_seen += images if epoch else 0
        seconds += time.perf_counter() - start if epoch else 0.0
        evaluate(training.model, val_loader, device, len(train_set.classes), choice)
        state = {"model": training.model.state_dict(), "optimizer": training.optimizer.state_dict(), "epoch": epoch}
        torch.save(state, out / "checkpoint.pth")
    queue.put({"img_per_sec": images_seen / seconds, "workers": cores, "run_seconds": time.perf_counter() - started,
               **peak_memory(device)})  # fmt: skip


def image_folder(data_path, transform, images: list[str]) -> ImageFolder:
    """torchvision's ImageFolder of `data_path` holding `images` alone."""
    wanted = {os.path.normpath(image) for image in images}
    return ImageFolder(data_path, transform, is_valid_file=lambda p: os.path.normpath(p) in wanted, allow_empty=True)


def in_fresh_process(name: str, target, *args) -> dict:
    """What `target(queue, *args)` puts on the queue, run in a process forked from a forkserver with torch imported."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # By its name: Python 3.11's forkserver does not preload "__main__" from a script's path
        context.set_forkserver_preload(["tools.fresh_rows"])
    else:  # Windows has no fork server: each row a new interpreter
        context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(queue, *args))
    process.start()
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except Empty:
            if not process.is_alive():
                raise UserError(f"{name}: its process failed (exit status {process.exitcode}); see above") from None
    process.join()
    return result
