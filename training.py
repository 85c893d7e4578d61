"""What a training run does in each of its processes, whatever started them: `train`, the recipe, and the
builders it uses (loaders, model, optimizer), which take explicit values so that tools and tests build exactly
what the scripts build.

The launch scripts differ only in how they start processes and join them into a group; from `train` on, one
process and eight run the same code, with rank 0 alone printing and writing files.
"""

import functools
import math
import time
from pathlib import Path

import torch
from torch.optim import lr_scheduler
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from checkpoint import CHECKPOINT_NAME, load_checkpoint, restore, save_epoch, training_state
from compute import Compute, choose_compute
from flags import Plan
from machine import core_budget
from model import create_model, freeze_all_but_head, load_weights
from multi_train_utils.distributed_utils import Process, broadcast_object, is_main_process, on_main_process
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch
from my_dataset import DataSplit, MyDataSet, SeededBatchSampler, SeededSamples, train_transform, val_transform
from run_log import RunLog, epoch_metrics, run_record
from utils import OutputError, describe


def train(args, plan: Plan, process: Process) -> dict:
    """Train and validate in this process for args.epochs epochs; returns the last epoch's metrics."""
    device, split, classes = process.device, plan.split, plan.split.classes
    workers, threads = core_budget(device, process.local_world_size, args.batch_size, args.workers)
    if device.type == "cpu":  # this process's compute threads: its share of the cores, less its loader workers
        torch.set_num_threads(threads)
    output_dir = Path(broadcast_object(str(plan.output_dir)))  # rank 0's name, whatever each rank's clock said
    announce(args.script, process, split, workers)
    train_loader, val_loader = build_loaders(
        split, img_size=args.img_size, batch_size=args.batch_size, seed=args.seed, world_size=process.world_size,
        rank=process.rank, workers=workers, persistent_workers=args.persistent_workers,
    )  # fmt: skip
    compute, why = choose_compute(args.amp, args.channels_last, device, args.img_size)
    say(why)
    model, plain_model = build_model(
        len(classes), device, compute, seed=args.seed, weights=plan.weights, freeze=args.freeze_layers,
        sync_bn=args.sync_bn, distributed=process.distributed, data_parallel=args.data_parallel,
        compile=args.compile,
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(
        model, lr=args.lr, world_size=process.world_size, momentum=args.momentum,
        weight_decay=args.weight_decay, epochs=args.epochs, lrf=args.lrf,
    )  # fmt: skip
    say(f"Learning rate {optimizer.param_groups[0]['lr']:g} (--lr {args.lr:g} x world size {process.world_size}); "
        f"global batch {args.batch_size * process.world_size}")  # fmt: skip
    scaler = compute.grad_scaler(device)
    start_epoch, best_acc = 0, -1.0
    if plan.resume is not None:
        start_epoch, best_acc = restore(load_checkpoint(plan.resume), plain_model, optimizer, scheduler, scaler)
        say(f"Resuming from {plan.resume}: epoch {start_epoch} of {args.epochs}, best val acc so far {best_acc:.3f}")
    run = run_record(
        args, data_path=plan.data_path, weights=plan.weights, resume=plan.resume, output_dir=output_dir,
        world_size=process.world_size, device=str(device), channels_last=compute.channels_last,
    )  # fmt: skip
    log = RunLog(output_dir, run, classes, start_epoch, val_loader.dataset, enabled=is_main_process())

    expected = (len(train_loader) * args.batch_size * process.world_size, len(split.val_images))  # every epoch's
    limits = [0 if args.strict_images else max(1, count // 100) for count in expected]  # unreadable images: 1 %
    metrics = {}
    for epoch in range(start_epoch, args.epochs):
        train_loader.batch_sampler.set_epoch(epoch)  # a new shuffle (and new augmentation) every epoch
        lr, start = optimizer.param_groups[0]["lr"], time.perf_counter()
        train_loss, images = train_one_epoch(model, optimizer, train_loader, device, epoch, compute, scaler, limits[0])
        train_seconds = time.perf_counter() - start
        scheduler.step()
        confusion = evaluate(plain_model, val_loader, device, len(classes), compute, limits[1])
        metrics = epoch_metrics(
            epoch, train_loss, images, train_seconds, time.perf_counter() - start, confusion, lr,
            process.world_size, device, expected,
        )  # fmt: skip
        improved, best_acc = metrics["val_acc"] > best_acc, max(best_acc, metrics["val_acc"])
        state = functools.partial(  # the checkpoint's contents, gathered by rank 0 alone, when it saves
            training_state, epoch, plain_model, optimizer, scheduler, scaler, best_acc, classes, process.world_size, run
        )
        # Rank 0 writes; no rank starts the next epoch before this one's checkpoint is on disk, or goes on if not.
        on_main_process(write_epoch, log, metrics, best_acc, plain_model, compute, output_dir, improved, state)
    log.close()
    say(f"Done: best val acc {best_acc:.3f}; weights in {output_dir / 'weights'}")
    return metrics


def write_epoch(log: RunLog, metrics, best_acc, plain_model, compute, output_dir: Path, improved, state) -> None:
    """Everything an epoch leaves on disk: its log lines, its weights, then the checkpoint (`state()`)."""
    try:
        log.epoch(metrics, best_acc, plain_model, compute)
        save_epoch(output_dir, metrics["epoch"], plain_model.state_dict(), improved, state())
    except OutputError as error:
        last = output_dir / CHECKPOINT_NAME  # each finished epoch wrote one: it is the epoch before this one's
        kept = f"{last} (epoch {metrics['epoch'] - 1}) is untouched" if last.exists() else "no checkpoint yet"
        raise OutputError(f"{error}; stopped, {kept}: make room, then continue with --resume {last}") from None


def say(*message) -> None:
    if is_main_process():
        print(*message, flush=True)


def announce(script: str, process: Process, split: DataSplit, workers: int) -> None:
    """The run's first lines: how many processes on what, and the data."""
    backend = f", backend {torch.distributed.get_backend()}" if process.distributed else ""
    say(f"{script}: {process.world_size} process(es) on {process.device.type}{backend}")
    if process.device.type == "cpu" and not torch.cuda.is_available():
        say("No CUDA GPU found: training on the CPU.")
    if split.unreadable:
        say(f"warning: skipped {len(split.unreadable)} unreadable image(s): {describe(split.unreadable)}")
    say(
        f"Data: {len(split.train_images)} training / {len(split.val_images)} validation images, "
        f"{len(split.classes)} classes{' (train/, val/ as given)' * split.given}; {workers} loader workers per process"
    )


def build_loaders(
    split: DataSplit,
    *,
    img_size: int,
    batch_size: int,
    seed: int,
    world_size: int = 1,
    rank: int = 0,
    workers: int = 0,
    persistent_workers: bool = True,
    pin_memory: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """This rank's training loader (its shard of a seeded shuffle, augmentation seeded per sample) and its
    validation loader (images rank, rank + world_size, ...: every image counted once over the ranks)."""
    train_set = SeededSamples(MyDataSet(split.train_images, split.train_labels, train_transform(img_size)))
    val_set = MyDataSet(split.val_images, split.val_labels, val_transform(img_size))
    # One sampler for every launch mode: a world of one is DistributedSampler(num_replicas=1). Shards are disjoint
    # (drop_last: the sampler drops the tail instead of repeating images to even them out), and incomplete
    # batches are dropped, so every step of every rank has the same batch size.
    shard = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    batches = SeededBatchSampler(BatchSampler(shard, batch_size, drop_last=True), seed)
    common = {
        "num_workers": workers,
        "persistent_workers": workers > 0 and persistent_workers,
        "pin_memory": pin_memory,
    }
    train_loader = DataLoader(train_set, batch_sampler=batches, **common)
    # Validation: rank r takes images r, r+W, r+2W, ...: disjoint, nothing padded, each image counted once.
    val_loader = DataLoader(val_set, batch_size=batch_size, sampler=range(rank, len(val_set), world_size), **common)
    return train_loader, val_loader


def build_model(
    num_classes: int,
    device: torch.device,
    compute: Compute = Compute(),
    *,
    seed: int = 0,
    weights: Path | None = None,
    freeze: bool = False,
    sync_bn: bool = False,
    distributed: bool = False,
    data_parallel: bool = False,
    compile: bool = False,
):
    """ResNet-34 with its initial weights (seeded, or from `weights`), on `device` in the compute's memory
    layout; in DDP wrapped, with SyncBatchNorm when `sync_bn`.

    Returns (the model to train, the same model without the DDP wrapper or compilation, for evaluating and
    saving: its parameter names carry no "module." or "_orig_mod." prefix).
    """
    torch.manual_seed(seed)  # the same initial weights in every process; DDP also broadcasts rank 0's
    model = create_model(num_classes)
    if weights is not None:
        say(f"Weights from {weights}: {load_weights(model, weights).summary()}")
    if freeze:
        freeze_all_but_head(model)
    model.to(device, memory_format=compute.memory_format)
    plain = model
    if data_parallel:
        model = data_parallel_over_gpus(model, device)
    if distributed:
        if sync_bn and not freeze:  # training the head alone, synchronised statistics buy nothing
            model = plain = convert_sync_batchnorm(model, device)
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if compile:
        model = torch.compile(model)  # compiles at the first step; DDP's buckets are respected by its optimizer
    return model, plain


def data_parallel_over_gpus(model, device: torch.device):
    """nn.DataParallel over every visible GPU, `device` first (it gathers the outputs and holds the master copy);
    the model itself where there is only one device to run on."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        say(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    say(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])


def build_optimizer(
    model, *, lr: float, world_size: int, momentum: float, weight_decay: float, epochs: int, lrf: float
):
    """SGD with momentum over the trainable parameters, and the cosine schedule from the rate down to rate * lrf.

    The rate is `lr` times the world size: DDP averages gradients over a global batch that many times larger.
    """
    rate = lr * world_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=rate, momentum=momentum, weight_decay=weight_decay)
    scheduler = lr_scheduler.LambdaLR(optimizer, lambda epoch: cosine_factor(epoch, epochs, lrf))
    return optimizer, scheduler


def cosine_factor(epoch: int, epochs: int, lrf: float) -> float:
    """Learning-rate factor: 1 at the first epoch, falling along a half cosine to lrf after the last."""
    return ((1 + math.cos(epoch * math.pi / epochs)) / 2) * (1 - lrf) + lrf
