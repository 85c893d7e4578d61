"""What a training run is, whatever starts its processes: the flags, the checks before any process starts, and
`train`, which every launch script calls in each of its processes.

The launch scripts differ only in how they start processes and join them into a group; from `train` on, one
process and eight run the same code, with rank 0 alone printing and writing files.
"""

import argparse
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim import lr_scheduler
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from checkpoint import CHECKPOINT_NAME, load_checkpoint, restore_rng, save_atomically, training_state
from machine import available_cores, cpu_bfloat16
from model import IMAGENET, create_model, freeze_all_but_head, load_weights, weights_file
from multi_train_utils.distributed_utils import barrier, broadcast_object, get_world_size, is_main_process
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Compute, evaluate, train_one_epoch
from my_dataset import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MyDataSet,
    SeededBatchSampler,
    train_min_side,
    train_transform,
    val_min_side,
    val_transform,
)
from utils import (
    DEMO_DATA_PATH,
    DataSplit,
    HelpFormatter,
    Parser,
    UserError,
    describe,
    make_demo_data,
    number,
    plain_args,
    positive_float,
    positive_int,
    read_split_data,
    write_atomically,
    write_class_indices,
    write_json,
)

# --demo trains on generated data with settings that finish in a few minutes on a laptop CPU; any flag given
# on the command line still wins.
DEMO_DEFAULTS = {"epochs": 8, "img_size": 48, "batch_size": 32, "lr": 0.01}


def switch(group, flag: str, default: bool | None, help: str) -> None:
    """A real on/off flag: --name and --no-name (argparse's type=bool would take "False" as true)."""
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def build_parser(script: str, description: str) -> argparse.ArgumentParser:
    """The flags of all three scripts; `script` adds the few that belong to one launch mode."""
    p = Parser(description=description, formatter_class=HelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument(
        "--data-path", type=Path, help="folder with one sub-folder of images per class (e.g. flower_photos)"
    )
    data.add_argument(
        "--demo",
        action="store_true",
        help=f"train on generated demo flowers (made once in {DEMO_DATA_PATH.parent.name}/) with quick settings",
    )
    data.add_argument(
        "--num-classes", type=positive_int, help="expected number of classes (default: the number of class folders)"
    )
    data.add_argument(
        "--val-rate",
        type=number(float, 0, 1, above_minimum=True),
        default=0.2,
        help="fraction of each class held out for validation",
    )
    data.add_argument(
        "--img-size",
        type=positive_int,
        default=224,
        help="training crop size; validation resizes to img-size*256/224 and centre-crops",
    )
    data.add_argument(
        "--workers",
        type=number(int, 0),
        help="data loader processes per training process (default: on a GPU, this process's share of the cores, "
        "at most 8; on the CPU, one per 8 cores of its share, the rest training)",
    )

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=positive_int, default=30, help="passes over the training images")
    opt.add_argument("--batch-size", type=positive_int, default=16, help="images per step in each process")
    opt.add_argument(
        "--lr",
        type=positive_float,
        default=0.001,
        help="learning rate for one process; multiplied by the world size in DDP",
    )
    opt.add_argument(
        "--lrf",
        type=number(float, 0, 1, above_minimum=True),
        default=0.1,
        help="final learning rate as a fraction of --lr (cosine decay)",
    )
    opt.add_argument("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    opt.add_argument(
        "--weight-decay",
        type=number(float, 0),
        default=1e-4,
        help="L2 penalty (the original used 5e-3; 1e-4 is usual for ResNets)",
    )
    opt.add_argument(
        "--seed", type=number(int, 0), default=0, help="seeds weights, data split, shuffling and augmentation"
    )

    model = p.add_argument_group("model")
    model.add_argument(
        "--weights",
        type=lambda text: text if text == IMAGENET else Path(text),
        help=f"initial weights: {IMAGENET} (torchvision's ImageNet-1K weights, downloaded once into torch's cache), "
        "a torchvision ResNet-34 file, or weights or a checkpoint saved by these scripts",
    )
    switch(model, "--freeze-layers", False, "train only the final layer")

    speed = p.add_argument_group("speed")
    speed.add_argument(
        "--amp",
        choices=["auto", "off", "bf16", "fp16"],
        default="auto",
        help="mixed precision (torch.amp autocast): auto is bf16 where the device computes it natively "
        "(GPUs from Ampere on, CPUs with AMX or AVX512-BF16 that torch is not capped below) and off (float32) "
        "elsewhere; fp16 adds gradient scaling",
    )
    switch(
        speed,
        "--channels-last",
        None,
        "keep images and weights in NHWC memory layout (default: on GPUs, and on the CPU for images of "
        f"{CHANNELS_LAST_MIN_SIZE} px and up, where it is faster)",
    )
    speed.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model: faster steps after a compilation of a minute or more at the start",
    )
    switch(
        speed,
        "--persistent-workers",
        True,
        "keep loader processes between epochs (off restarts them every epoch, as the original scripts did)",
    )

    run = p.add_argument_group("run")
    run.add_argument("--resume", type=Path, help="continue the run whose checkpoint.pth this is (in its folder)")
    run.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue from --output-dir's checkpoint.pth when there is one, else start (for torchrun restarts)",
    )
    run.add_argument(
        "--strict-images", action="store_true", help="stop on unreadable images instead of skipping them with a warning"
    )
    run.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    run.add_argument(
        "--output-dir", type=Path, help=f"where weights, logs and metrics go (default: runs/{script}-<timestamp>)"
    )

    if script == "train_single_gpu":
        model.add_argument(
            "--data-parallel",
            action="store_true",
            help="split each batch over all visible GPUs with nn.DataParallel in this one process "
            "(DDP, the other two scripts, is faster: see the README)",
        )
    else:
        p.set_defaults(data_parallel=False)
        dist = p.add_argument_group("distributed")
        switch(dist, "--sync-bn", True, "synchronise BatchNorm statistics across processes")
        dist.add_argument(
            "--dist-url",
            default="env://",
            help="how processes find each other (env:// reads MASTER_ADDR and MASTER_PORT)",
        )
        dist.add_argument(
            "--dist-backend",
            choices=["nccl", "gloo"],
            help="communication library (default: nccl on CUDA, gloo on CPU)",
        )
        dist.add_argument(
            "--dist-timeout",
            type=positive_int,
            default=1800,
            help="seconds a collective may wait for a silent process",
        )
    if script == "train_multi_gpu_using_spawn":
        dist.add_argument(
            "--world-size", type=positive_int, help="processes to start (default: visible GPUs, or 2 without a GPU)"
        )
    p.set_defaults(script=script)
    return p


def parse_args(script: str, description: str, argv=None) -> argparse.Namespace:
    parser = build_parser(script, description)
    args = parser.parse_args(argv)
    if args.demo:
        parser.set_defaults(**DEMO_DEFAULTS)
        args = parser.parse_args(argv)
    return args


def prepare(args, world_size: int) -> DataSplit:
    """Checks and one-time set-up that need no process group, run before processes start where possible.

    Makes the demo data, splits the dataset (checking every image can be read), decides the output folder and
    whether the run resumes, and raises UserError for bad input, so that mistakes surface before any training.
    """
    if args.demo and args.data_path is None:
        args.data_path = DEMO_DATA_PATH
    if args.data_path is None:
        raise UserError("no data: give --data-path FOLDER (one sub-folder per class) or --demo")
    if args.demo:
        make_demo_data(args.data_path)
    split = read_split_data(args.data_path, args.val_rate, args.seed, verify_images=True)
    if split.unreadable and args.strict_images:
        raise UserError(f"{len(split.unreadable)} unreadable image(s) (--strict-images): {describe(split.unreadable)}")
    if args.num_classes is not None and args.num_classes != len(split.classes):
        raise UserError(
            f"--num-classes {args.num_classes} but {args.data_path} has {len(split.classes)} class folders: "
            + ", ".join(split.classes)
        )
    if args.weights is not None:
        args.weights = weights_file(args.weights)  # `imagenet`: downloaded here, before any worker starts
        load_weights(create_model(len(split.classes)), args.weights)  # refuse an unusable file before starting
    per_process = len(split.train_images) // world_size
    if per_process < args.batch_size:
        raise UserError(
            f"--batch-size {args.batch_size} is larger than the {per_process} training images each of "
            f"{world_size} process(es) gets: an epoch would have no step"
        )

    if args.auto_resume:
        if args.output_dir is None:
            raise UserError("--auto-resume needs --output-dir: the folder where a restarted job finds its checkpoint")
        if args.resume is None and (args.output_dir / CHECKPOINT_NAME).exists():
            args.resume = args.output_dir / CHECKPOINT_NAME
    if args.resume is not None:
        state = load_checkpoint(args.resume)
        if state["classes"] != split.classes:
            raise UserError(f"{args.resume} was trained on classes {state['classes']}, the data has {split.classes}")
        if state["world_size"] != world_size:
            raise UserError(f"{args.resume} was made by {state['world_size']} process(es); resume with as many")
        check_same_recipe(args.resume, state["args"], args)
        args.output_dir = args.output_dir or args.resume.parent
    elif args.output_dir is None:
        args.output_dir = Path("runs") / f"{args.script}-{time.strftime('%Y%m%d-%H%M%S')}"
    elif (args.output_dir / "metrics.jsonl").exists():
        raise UserError(
            f"{args.output_dir} already holds a run: continue it with --auto-resume, or choose another --output-dir"
        )
    check_writable(args.output_dir)
    return split


# The flags that decide what a run computes: a resumed run must keep them, or its epochs would follow two
# different recipes (a new --epochs, say, would bend the learning-rate schedule half way). Speed flags (--amp,
# --channels-last, --workers, --device, ...) may change: they change rounding, not the recipe.
RECIPE_FLAGS = (
    "epochs", "batch_size", "lr", "lrf", "momentum", "weight_decay", "seed", "val_rate", "img_size", "freeze_layers",
    "sync_bn",
)  # fmt: skip


def check_same_recipe(checkpoint: Path, saved: dict, args) -> None:
    """UserError naming every recipe flag whose value differs from the one the checkpoint's run used."""
    given = vars(args)
    changed = [
        f"--{name.replace('_', '-')} {saved[name]} (not {given[name]})"
        for name in RECIPE_FLAGS
        if name in saved and name in given and saved[name] != given[name]
    ]
    if changed:
        raise UserError(
            f"{checkpoint} was trained with {', '.join(changed)}: resume with the run's own flags, or start a "
            f"new run from its weights (--weights {checkpoint.parent / 'weights' / 'best.pth'})"
        )


def check_writable(folder: Path) -> None:
    """UserError unless `folder` can be created (or exists) and written to; creates nothing."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise UserError(f"cannot write the output folder {folder}: {error.strerror} ({existing})") from None


# On the CPU, loading an image (decode, crop, flip, normalise) costs a few percent of training on it (1.4 ms of
# one core against about 60 core-milliseconds at 224 px with bf16 here): one loader process keeps up with 8 cores.
CORES_PER_CPU_LOADER = 8


def core_budget(args) -> tuple[int, int]:
    """(loader workers, compute threads) for this process, from its share of the machine's cores.

    On a GPU the cores only prepare data: up to 8 workers. On the CPU the same cores also train, and a loader
    process that takes a core away from a compute thread stalls every parallel operation until that thread
    catches up: so a worker per 8 cores, and the compute threads on the rest (on 2 cores: no worker, images
    loaded between steps; measured 30.0 img/s against 28.0 with 2 workers, at 224 px with bf16). --workers
    changes the workers, not the threads.
    """
    share = max(1, available_cores() // args.local_world_size)
    if args.device.startswith("cuda"):
        workers = min(8, share, args.batch_size) if args.workers is None else args.workers
        return workers, torch.get_num_threads()
    reserved = share // CORES_PER_CPU_LOADER  # cores kept for loading, whatever --workers says
    return (reserved if args.workers is None else args.workers), max(1, share - reserved)


def build_loaders(args, split, world_size: int, rank: int):
    size = args.img_size
    train_set = MyDataSet(split.train_images, split.train_labels, train_transform(size), train_min_side(size))
    val_set = MyDataSet(split.val_images, split.val_labels, val_transform(size), val_min_side(size))
    # One sampler for every launch mode: a world of one is DistributedSampler(num_replicas=1). Shards are disjoint
    # (drop_last: the sampler drops the tail instead of repeating images to even them out), and incomplete
    # batches are dropped, so every step of every rank has the same batch size.
    shard = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    batches = SeededBatchSampler(BatchSampler(shard, args.batch_size, drop_last=True), args.seed)
    workers, _ = core_budget(args)
    common = {
        "num_workers": workers,
        "persistent_workers": workers > 0 and args.persistent_workers,
        "pin_memory": args.device.startswith("cuda"),
    }
    train_loader = DataLoader(train_set, batch_sampler=batches, **common)
    # Validation: rank r takes images r, r+W, r+2W, ...: disjoint, nothing padded, each image counted once.
    val_loader = DataLoader(
        val_set, batch_size=args.batch_size, sampler=range(rank, len(val_set), world_size), **common
    )
    return train_loader, val_loader, workers


def say(*message) -> None:
    if is_main_process():
        print(*message, flush=True)


# On the CPU, channels_last pays only where the last stage's feature maps are 3x3 or larger: images of 96 px and
# up, at ResNet's stride of 32. At 2x2 and below, torch converts each convolution's weights between the two
# layouts at every step (measured on an AVX2 CPU: +17 ms per 512x512 3x3 convolution at 2x2, +62 %; at 32 px the
# whole model trains 21 % slower in channels_last). From 96 px it is as fast or faster: +5-10 % at 224 px on AVX2,
# +17 % (float32) and +26 % (bfloat16) on AMX.
CHANNELS_LAST_MIN_SIZE = 96


def choose_compute(amp: str, channels_last: bool | None, device: torch.device, img_size: int) -> tuple[Compute, str]:
    """The precision and memory layout to train in, and a line saying which and why.

    amp "auto": bfloat16 where the device computes it natively (GPUs from Ampere on; CPUs with AMX or
    AVX512-BF16, unless ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA cap torch below them), float32 elsewhere.
    channels_last None: on GPUs, and on the CPU from CHANNELS_LAST_MIN_SIZE px up. Given values win.
    """
    if amp == "auto":
        if device.type == "cuda":
            native = torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere and later compute bf16 natively
            why = "this GPU computes bfloat16 natively" if native else "this GPU has no native bfloat16"
        else:
            native, why = cpu_bfloat16()
        amp, amp_reason = ("bf16" if native else "off"), f"--amp auto: {why}"
    else:
        amp_reason = f"--amp {amp}"
    if channels_last is None:
        channels_last = device.type == "cuda" or img_size >= CHANNELS_LAST_MIN_SIZE
        layout_reason = (
            "auto: GPUs convolve fastest in it"
            if device.type == "cuda"
            else f"auto: {img_size} px {'>=' if channels_last else '<'} {CHANNELS_LAST_MIN_SIZE} px on the CPU"
        )
    else:
        layout_reason = "--channels-last" if channels_last else "--no-channels-last"
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    name = {"off": "float32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast with gradient scaling"}[amp]
    layout = "channels_last" if channels_last else "NCHW"
    return Compute(dtype, channels_last), f"Precision: {name} ({amp_reason}); memory layout {layout} ({layout_reason})"


def build_model(args, num_classes: int, device: torch.device):
    """ResNet-34 with its initial weights, on `device`; in DDP wrapped (and SyncBN-converted when asked).

    Returns (the model to train, the same model without the DDP wrapper or compilation, for evaluating and
    saving: its parameter names carry no "module." or "_orig_mod." prefix).
    """
    torch.manual_seed(args.seed)  # the same initial weights in every process; DDP also broadcasts rank 0's
    model = create_model(num_classes)
    if args.weights is not None:
        report = load_weights(model, args.weights)
        say(f"Weights from {args.weights}: {report.summary()}")
    if args.freeze_layers:
        freeze_all_but_head(model)
    model.to(device, memory_format=Compute(channels_last=args.channels_last).memory_format)
    plain = model
    if args.data_parallel:
        model = data_parallel(model, device)
    if args.distributed:
        if args.sync_bn and not args.freeze_layers:  # training the head alone, synchronised statistics buy nothing
            model = plain = convert_sync_batchnorm(model, device)
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if args.compile:
        model = torch.compile(model)  # compiles at the first step; DDP's buckets are respected by its optimizer
    return model, plain


def data_parallel(model, device: torch.device):
    """nn.DataParallel over every visible GPU, `device` first (it gathers the outputs and holds the master copy);
    the model itself where there is only one device to run on."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        say(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    say(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])


def build_optimizer(args, model):
    """SGD with momentum over the trainable parameters, and the cosine schedule from lr down to lr * lrf.

    The rate is --lr times the world size: DDP averages gradients over a global batch that many times larger.
    """
    lr = args.lr * get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = lr_scheduler.LambdaLR(optimizer, lambda epoch: cosine_factor(epoch, args.epochs, args.lrf))
    return optimizer, scheduler


def train(args, split: DataSplit) -> dict:
    """Train and validate in this process (one of args.world_size) until args.epochs; returns the last metrics."""
    world_size, rank = args.world_size, args.rank
    device = torch.device(args.device)
    if device.type == "cpu":  # this process's compute threads: its share of the cores, less its loader workers
        torch.set_num_threads(core_budget(args)[1])
    output_dir = Path(broadcast_object(str(args.output_dir)))  # rank 0's name, whatever each rank's clock said
    weights_dir = output_dir / "weights"
    if is_main_process():
        weights_dir.mkdir(parents=True, exist_ok=True)
        write_class_indices(split.classes, output_dir)
    barrier()
    num_classes = len(split.classes)

    say(
        f"{args.script}: {world_size} process(es) on {device.type}"
        + (f", backend {torch.distributed.get_backend()}" if args.distributed else "")
    )
    if device.type == "cpu" and torch.cuda.is_available() is False:
        say("No CUDA GPU found: training on the CPU.")
    if split.unreadable:
        say(f"warning: skipped {len(split.unreadable)} unreadable image(s): {describe(split.unreadable)}")
    train_loader, val_loader, workers = build_loaders(args, split, world_size, rank)
    say(
        f"Data: {len(split.train_images)} training / {len(split.val_images)} validation images, "
        f"{num_classes} classes; {workers} loader workers per process"
    )

    compute, compute_summary = choose_compute(args.amp, args.channels_last, device, args.img_size)
    args.channels_last = compute.channels_last  # what "auto" chose: build_model and args.json take it
    say(compute_summary)
    model, model_without_ddp = build_model(args, num_classes, device)
    optimizer, scheduler = build_optimizer(args, model)
    scaler = compute.grad_scaler(device)
    say(
        f"Learning rate {optimizer.param_groups[0]['lr']:g} (--lr {args.lr:g} x world size {world_size}); "
        f"global batch {args.batch_size * world_size}"
    )
    start_epoch, best_acc = 0, -1.0
    if args.resume is not None:
        state = load_checkpoint(args.resume)
        model_without_ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        restore_rng(state)
        start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]
        say(f"Resuming from {args.resume}: epoch {start_epoch} of {args.epochs}, best val acc so far {best_acc:.3f}")
        if is_main_process():
            keep_metrics_before(output_dir / "metrics.jsonl", start_epoch)

    writer = SummaryWriter(str(output_dir / "tb"), purge_step=start_epoch) if is_main_process() else None
    if is_main_process():
        say(f'Output: {output_dir}  (TensorBoard: tensorboard --logdir "{output_dir / "tb"}")')
        write_json(output_dir / "args.json", plain_args(args))
        write_hparams(writer, args)
        preview = preview_batch(val_loader.dataset)

    metrics = {}
    for epoch in range(start_epoch, args.epochs):
        train_loader.batch_sampler.set_epoch(epoch)  # a new shuffle (and new augmentation) every epoch
        epoch_lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        train_loss, train_images = train_one_epoch(model, optimizer, train_loader, device, epoch, compute, scaler)
        train_seconds = time.perf_counter() - start
        scheduler.step()
        confusion = evaluate(model_without_ddp, val_loader, device, num_classes, compute)
        epoch_seconds = time.perf_counter() - start

        val_correct, val_total = int(confusion.trace()), int(confusion.sum())
        val_acc = val_correct / val_total
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss,
            "val_acc": val_acc,
            "val_correct": val_correct,
            "val_total": val_total,
            "val_per_class_correct": confusion.diagonal().tolist(),
            "val_per_class_total": confusion.sum(dim=1).tolist(),
            "lr": epoch_lr,
            "epoch_seconds": epoch_seconds,
            "train_images_per_sec": train_images / train_seconds,
            "world_size": world_size,
            **peak_memory(device),
        }
        improved, best_acc = val_acc > best_acc, max(best_acc, val_acc)
        if is_main_process():
            say(
                f"[epoch {epoch}] train loss {train_loss:.3f}  val acc {val_acc:.3f} ({val_correct}/{val_total})  "
                f"lr {epoch_lr:.2e}  {epoch_seconds:.1f} s, {metrics['train_images_per_sec']:.1f} img/s"
            )
            for tag, value in (
                ("loss", train_loss),
                ("accuracy", val_acc),
                ("learning_rate", epoch_lr),
                (BEST_ACC_TAG, best_acc),
            ):
                writer.add_scalar(tag, value, epoch)
            writer.add_figure(
                "validation_predictions", preview_figure(model_without_ddp, preview, split, compute), epoch
            )
            with open(output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            state_dict = model_without_ddp.state_dict()
            save_atomically(state_dict, weights_dir / f"model-{epoch}.pth")
            if improved:
                save_atomically(state_dict, weights_dir / "best.pth")
            # Last, so that a checkpoint never claims an epoch whose outputs are not all written.
            state = training_state(
                epoch, model_without_ddp, optimizer, scheduler, scaler, best_acc, split.classes, world_size, args
            )
            save_atomically(state, output_dir / CHECKPOINT_NAME)
        barrier()  # no rank starts the next epoch before this one's checkpoint is on disk
    if writer is not None:
        writer.close()
    say(f"Done: best val acc {best_acc:.3f}; weights in {weights_dir}")
    return metrics


BEST_ACC_TAG = "hparams/best_val_acc"  # the metric TensorBoard's HPARAMS tab shows beside each run's flags


def write_hparams(writer: SummaryWriter, args) -> None:
    """The run's flags in TensorBoard's HPARAMS tab, in the run's own event file (add_hparams would make another
    folder), with the best validation accuracy, logged each epoch, as their metric."""
    # Numbers stay numbers (sortable there); switches, paths and None become text ("True", not the 1 that
    # TensorBoard would make of a bool).
    flags = {
        key: value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
        for key, value in plain_args(args).items()
    }
    for summary in hparams(flags, {BEST_ACC_TAG: None}):
        writer.file_writer.add_summary(summary)


def preview_batch(val_set, count: int = 16):
    """`count` validation images spread over the set (so over the classes, which it lists in order) and their
    labels: the same images every epoch, to watch the predictions change."""
    picks = sorted({round(i * (len(val_set) - 1) / max(count - 1, 1)) for i in range(min(count, len(val_set)))})
    samples = [val_set[i] for i in picks]
    return torch.stack([image for image, _ in samples]), [label for _, label in samples]


@torch.no_grad()
def preview_figure(model, preview, split: DataSplit, compute: Compute):
    """The preview images titled with the model's predictions (green right, red wrong), for TensorBoard."""
    images, labels = preview
    device = next(model.parameters()).device
    model.eval()
    with compute.autocast(device):
        predicted = model(compute.batch_to(images, device)).argmax(dim=1).tolist()
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    pixels = (images * std + mean).clamp(0, 1).permute(0, 2, 3, 1).numpy()  # undo Normalize, to HxWx3
    from plot_results import plot_predictions  # matplotlib: imported by rank 0 alone, when it first draws

    return plot_predictions(pixels, labels, predicted, split.classes)


def peak_memory(device: torch.device) -> dict:
    """This process's peak resident memory so far (loader workers not included), and on CUDA its GPU's peak."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, kilobytes on Linux
    peak = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20)}
    if device.type == "cuda":
        peak["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return peak


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["epoch"] < epoch]
        write_atomically(path, lambda f: f.writelines(lines))


def cosine_factor(epoch: int, epochs: int, lrf: float) -> float:
    """Learning-rate factor: 1 at the first epoch, falling along a half cosine to lrf after the last."""
    return ((1 + math.cos(epoch * math.pi / epochs)) / 2) * (1 - lrf) + lrf
