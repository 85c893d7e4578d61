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
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from checkpoint import CHECKPOINT_NAME, load_checkpoint, restore, save_epoch, training_state
from compute import Compute, choose_compute
from flags import Plan
from machine import core_budget
from model import DEFAULT_MODEL, create_model, freeze_all_but_head, load_weights
from multi_train_utils.distributed_utils import Process, broadcast_object, is_main_process, on_main_process
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch
from my_dataset import DataSplit, MyDataSet, SeededBatchSampler, SeededSamples, train_transform, val_transform
from recipe import Objective, balanced_class_weights, build_optimizer, model_ema
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
        pin_memory=device.type == "cuda", auto_augment=args.auto_augment, random_erase=args.random_erase,
    )  # fmt: skip
    compute, why = choose_compute(args.amp, args.channels_last, device, args.img_size)
    say(why)
    model, plain_model = build_model(
        len(classes), device, compute, name=args.model, seed=args.seed, weights=plan.weights,
        freeze=args.freeze_layers, sync_bn=args.sync_bn, distributed=process.distributed,
        data_parallel=args.data_parallel, compile=args.compile,
    )  # fmt: skip
    optimizer, scheduler, objective, ema = build_recipe(args, model, plain_model, split, len(train_loader), process)
    scaler = compute.grad_scaler(device)
    start_epoch, best_acc = 0, -1.0
    if plan.resume is not None:
        start_epoch, best_acc = restore(load_checkpoint(plan.resume), plain_model, optimizer, scheduler, scaler, ema)
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
        train_loss, images = train_one_epoch(
            model, optimizer, train_loader, device, epoch, compute, scaler, limits[0], objective=objective,
            scheduler=scheduler, accumulate=args.accumulate, ema=ema,
        )  # fmt: skip
        train_seconds = time.perf_counter() - start
        confusion, ema_metrics = validate(plain_model, ema, val_loader, device, len(classes), compute, limits[1])
        metrics = epoch_metrics(
            epoch, train_loss, images, train_seconds, time.perf_counter() - start, confusion, lr,
            process.world_size, device, expected,
        ) | ema_metrics  # fmt: skip
        accuracy = max(metrics["val_acc"], metrics.get("ema_val_acc", -1.0))
        better = ema.module if metrics.get("ema_val_acc", -1.0) > metrics["val_acc"] else plain_model  # tie: model
        best, best_acc = better if accuracy > best_acc else None, max(best_acc, accuracy)
        state = functools.partial(  # the checkpoint's contents, gathered by rank 0 alone, when it saves
            training_state, epoch, plain_model, optimizer, scheduler, scaler, best_acc, classes, process.world_size,
            run, ema,
        )  # fmt: skip
        # Rank 0 writes; no rank starts the next epoch before this one's checkpoint is on disk, or goes on if not.
        on_main_process(write_epoch, log, metrics, best_acc, plain_model, best, compute, output_dir, args, state)
    log.close()
    say(f"Done: best val acc {best_acc:.3f}; weights in {output_dir / 'weights'}")
    return metrics


def write_epoch(log: RunLog, metrics, best_acc, plain_model, best, compute, output_dir: Path, args, state) -> None:
    """Everything an epoch leaves on disk: its log lines, its weights (and `best`'s, when it improved on the best
    accuracy), then the checkpoint (`state()`)."""
    epoch = metrics["epoch"]
    try:
        log.epoch(metrics, best_acc, plain_model, compute)
        keep = args.save_every > 0 and (epoch + 1) % args.save_every == 0
        best_weights = best.state_dict() if best is not None else None
        save_epoch(output_dir, epoch, plain_model.state_dict(), best_weights, state(), keep=keep)
    except OutputError as error:
        last = output_dir / CHECKPOINT_NAME  # each finished epoch wrote one: it is the epoch before this one's
        kept = f"{last} (epoch {epoch - 1}) is untouched" if last.exists() else "no checkpoint yet"
        raise OutputError(f"{error}; stopped, {kept}: make room, then continue with --resume {last}") from None


def validate(plain_model, ema, val_loader, device, num_classes: int, compute: Compute, max_skipped):
    """The epoch's validation: the model's confusion matrix, and with an EMA its accuracy too (as `ema_` metrics,
    computed as epoch_metrics computes val_acc)."""
    confusion = evaluate(plain_model, val_loader, device, num_classes, compute, max_skipped)
    if ema is None:
        return confusion, {}
    averaged = evaluate(ema.module, val_loader, device, num_classes, compute, max_skipped)
    correct, total = int(averaged.trace()), int(averaged.sum())
    return confusion, {"ema_val_acc": correct / max(total, 1), "ema_val_correct": correct}


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
    auto_augment: str = "none",
    random_erase: float = 0.0,
) -> tuple[DataLoader, DataLoader]:
    """This rank's training loader (its shard of a seeded shuffle, augmentation seeded per sample) and its
    validation loader (images rank, rank + world_size, ...: every image counted once over the ranks)."""
    augment = train_transform(img_size, auto_augment=auto_augment, random_erase=random_erase)
    train_set = SeededSamples(MyDataSet(split.train_images, split.train_labels, augment))
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
    name: str = DEFAULT_MODEL,
    seed: int = 0,
    weights: Path | None = None,
    freeze: bool = False,
    sync_bn: bool = False,
    distributed: bool = False,
    data_parallel: bool = False,
    compile: bool = False,
):
    """torchvision's model `name` with its initial weights (seeded, or from `weights`), on `device` in the
    compute's memory layout; in DDP wrapped, with SyncBatchNorm when `sync_bn`.

    Returns (the model to train, the same model without the DDP wrapper or compilation, for evaluating and
    saving: its parameter names carry no "module." or "_orig_mod." prefix).
    """
    torch.manual_seed(seed)  # the same initial weights in every process; DDP also broadcasts rank 0's
    model = create_model(num_classes, name)
    if weights is not None:
        say(f"Weights from {weights}: {load_weights(model, weights, name=name).summary()}")
    if freeze:
        freeze_all_but_head(model, name)
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


def build_recipe(args, model, plain_model, split: DataSplit, batches: int, process: Process):
    """The optimizer and its schedule, the loss and the weights' average (None without --model-ema) that the
    flags ask for, for `batches` micro-batches an epoch."""
    optimizer, scheduler = build_optimizer(
        model, opt=args.opt, lr=args.lr, world_size=process.world_size, accumulate=args.accumulate,
        momentum=args.momentum, weight_decay=args.weight_decay, epochs=args.epochs, lrf=args.lrf,
        steps_per_epoch=math.ceil(batches / args.accumulate), warmup_epochs=args.warmup_epochs,
    )  # fmt: skip
    say(f"Learning rate {optimizer.param_groups[0]['initial_lr']:g} (--lr {args.lr:g} x {process.world_size} "
        f"process(es) x {args.accumulate} micro-batch(es)) for a global batch of "
        f"{args.batch_size * process.world_size * args.accumulate}")  # fmt: skip
    ema = model_ema(plain_model, args.ema_decay) if args.model_ema else None
    return optimizer, scheduler, build_objective(args, split), ema


def build_objective(args, split: DataSplit) -> Objective:
    """The loss the flags ask for: label smoothing, class weights from the training split, mixup and cutmix."""
    weights = (
        balanced_class_weights(split.train_labels, len(split.classes)) if args.class_weights == "balanced" else None
    )
    if weights is not None:
        shown = (f"{name} {weight:.2f}" for name, weight in zip(split.classes, weights.tolist(), strict=True))
        say("Class weights (balanced): " + ", ".join(shown))
    return Objective(args.label_smoothing, weights, args.mixup_alpha, args.cutmix_alpha, args.seed)
