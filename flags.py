"""The training scripts' flags, and the checks that turn them into a run's plan before any process starts.

`parse_args` reads the command line; `prepare` checks the input (the data, the weights, a checkpoint to resume,
the output folder), makes the demo data, splits the dataset and returns a Plan: everything `train` needs to
know that the flags alone do not say. Mistakes end here, in one line, before any training process starts.
"""

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoint import CHECKPOINT_NAME, load_checkpoint
from compute import CHANNELS_LAST_MIN_SIZE
from demo_data import DEMO_DATA_PATH, make_demo_data
from model import DEFAULT_MODEL, IMAGENET, create_model, load_weights, model_names, weights_file
from multi_train_utils.distributed_utils import launcher_environment
from my_dataset import AUTO_AUGMENT, DataSplit, read_split_data
from utils import (
    HelpFormatter,
    Parser,
    UserError,
    check_writable,
    describe,
    number,
    positive_float,
    positive_int,
    switch,
)

# The scripts' defaults for the image and batch size; predict.py and evaluate.py use them too where a run's own
# flags are not found.
DEFAULT_IMG_SIZE, DEFAULT_BATCH_SIZE = 224, 16
# --demo trains on generated data with settings that finish in a few minutes on a laptop CPU; any flag given
# on the command line still wins.
DEMO_DEFAULTS = {"epochs": 8, "img_size": 48, "batch_size": 32, "lr": 0.01}
# Weight decay by optimizer: SGD's is an L2 penalty added to the gradient, AdamW's is decoupled (applied to the
# weights directly, as a share of the learning rate), and their usual values differ by that much.
WEIGHT_DECAY = {"sgd": 1e-4, "adamw": 0.05}


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
        default=DEFAULT_IMG_SIZE,
        help="training crop size; validation resizes to img-size*256/224 and centre-crops",
    )
    data.add_argument(
        "--auto-augment",
        choices=["none", *AUTO_AUGMENT],
        default="none",
        help="a random photometric or geometric change per training image after the crop and flip "
        "(TrivialAugmentWide or RandAugment from torchvision)",
    )
    data.add_argument(
        "--random-erase",
        type=number(float, 0, 1),
        default=0.0,
        help="probability of erasing a random rectangle of each training image (RandomErasing)",
    )
    data.add_argument(
        "--class-weights",
        choices=["none", "balanced"],
        default="none",
        help="balanced: weigh each class's loss by the inverse of its share of the training images",
    )
    data.add_argument(
        "--workers",
        type=number(int, 0),
        help="data loader processes per training process (default: on a GPU, this process's share of the cores, "
        "at most 8; on the CPU, one per 8 cores of its share, the rest training)",
    )

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=positive_int, default=30, help="passes over the training images")
    opt.add_argument(
        "--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help="images per step in each process"
    )
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
    opt.add_argument(
        "--opt",
        choices=["sgd", "adamw"],
        default="sgd",
        help="optimizer: SGD with momentum, or AdamW (decoupled weight decay)",
    )
    opt.add_argument("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    opt.add_argument(
        "--weight-decay",
        type=number(float, 0),
        help=f"weight decay (default: {WEIGHT_DECAY['sgd']:g} with SGD, usual for ResNets (the original used 5e-3); "
        f"{WEIGHT_DECAY['adamw']:g} with AdamW)",
    )
    opt.add_argument(
        "--warmup-epochs",
        type=number(int, 0),
        default=0,
        help="epochs over which the learning rate rises linearly, step by step, before the cosine decay",
    )
    opt.add_argument(
        "--accumulate",
        type=positive_int,
        default=1,
        help="micro-batches of --batch-size whose gradients are summed before each step (a step then sees "
        "batch-size x accumulate x world-size images, and the learning rate is scaled by that many batches)",
    )
    opt.add_argument(
        "--label-smoothing",
        type=number(float, 0, 1),
        default=0.0,
        help="share of each target spread evenly over all classes",
    )
    opt.add_argument(
        "--mixup-alpha",
        type=number(float, 0),
        default=0.0,
        help="mix pairs of training images and their targets by a Beta(alpha, alpha) share (0: off)",
    )
    opt.add_argument(
        "--cutmix-alpha",
        type=number(float, 0),
        default=0.0,
        help="paste a box of one training image into another, targets by area (0: off; with mixup, each step "
        "takes one of the two at random)",
    )
    opt.add_argument(
        "--seed", type=number(int, 0), default=0, help="seeds weights, data split, shuffling and augmentation"
    )

    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=model_names(),
        default=DEFAULT_MODEL,
        metavar="NAME",
        help="any torchvision classification model: resnet18, resnet50, mobilenet_v3_small, efficientnet_b0, "
        "convnext_tiny, ...",
    )
    model.add_argument(
        "--weights",
        type=lambda text: text if text == IMAGENET else Path(text),
        help=f"initial weights: {IMAGENET} (torchvision's ImageNet-1K weights for --model, downloaded once into "
        "torch's cache), a torchvision file for that model, or weights or a checkpoint saved by these scripts",
    )
    switch(model, "--freeze-layers", False, "train only the classifier head")
    switch(
        model,
        "--model-ema",
        False,
        "keep an exponential moving average of the weights (BatchNorm statistics included), validated and "
        "saved beside the model; best.pth is the better of the two",
    )
    model.add_argument(
        "--ema-decay",
        type=number(float, 0, 1, above_minimum=True),
        default=0.999,
        help="share of the average kept at each step (0.999: about the last 1,000 steps)",
    )

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
        "--save-every",
        type=number(int, 0),
        default=0,
        help="also keep weights/model-N.pth of every N-th epoch (0: keep only best.pth, last.pth and the checkpoint)",
    )
    run.add_argument(
        "--strict-images", action="store_true", help="stop on unreadable images instead of skipping them with a warning"
    )
    run.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    run.add_argument(
        "--output-dir", type=Path, help=f"where weights, logs and metrics go (default: runs/{script}-<timestamp>)"
    )

    if script == "train_single_gpu":
        p.set_defaults(sync_bn=False)  # one process: BatchNorm's statistics are already the whole batch's
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
    if args.weight_decay is None:
        args.weight_decay = WEIGHT_DECAY[args.opt]
    if args.warmup_epochs >= args.epochs:
        parser.error(f"--warmup-epochs {args.warmup_epochs} leaves no epoch of --epochs {args.epochs} to decay")
    return args


@dataclass(frozen=True)
class Plan:
    """What prepare decided: the data folder and its split, the weights to start from, the checkpoint to resume
    (None for a new run) and the folder the run writes to."""

    data_path: Path
    split: DataSplit
    output_dir: Path
    weights: Path | None = None
    resume: Path | None = None


def prepare(args, world_size: int) -> Plan:
    """Check the input and make the one-time decisions that need no process group, for `world_size` processes.

    Makes the demo data, splits the dataset (checking every image can be read), finds the weights file, decides
    whether the run resumes and where it writes; raises UserError for bad input.
    """
    data_path = args.data_path or (DEMO_DATA_PATH if args.demo else None)
    if data_path is None:
        raise UserError("no data: give --data-path FOLDER (one sub-folder per class) or --demo")
    if args.demo:
        make_demo_data(data_path)
    split = read_split_data(data_path, args.val_rate, args.seed, verify_images=True)
    check_split(args, split, data_path, world_size)
    weights = None
    if args.weights is not None:
        weights = weights_file(args.weights, args.model)  # `imagenet`: downloaded here, before any worker starts
        # refuse an unusable file before starting
        load_weights(create_model(len(split.classes), args.model), weights, name=args.model)
    resume, output_dir = resume_and_output(args, split, world_size)
    check_writable(output_dir)
    return Plan(Path(data_path), split, output_dir, weights, resume)


def check_split(args, split: DataSplit, data_path: Path, world_size: int) -> None:
    if split.given and args.val_rate != build_parser(args.script, "").get_default("val_rate"):
        if (launcher_environment() or {}).get("rank", 0) == 0:  # under torchrun every rank prepares: say it once
            print(f"note: --val-rate {args.val_rate} is ignored: {data_path} holds train/ and val/, used as given")
    if split.unreadable and args.strict_images:
        raise UserError(f"{len(split.unreadable)} unreadable image(s) (--strict-images): {describe(split.unreadable)}")
    if args.num_classes is not None and args.num_classes != len(split.classes):
        raise UserError(
            f"--num-classes {args.num_classes} but {data_path} has {len(split.classes)} class folders: "
            + ", ".join(split.classes)
        )
    per_process = len(split.train_images) // world_size
    if per_process < args.batch_size:
        raise UserError(
            f"--batch-size {args.batch_size} is larger than the {per_process} training images each of "
            f"{world_size} process(es) gets: an epoch would have no step"
        )


def resume_and_output(args, split: DataSplit, world_size: int) -> tuple[Path | None, Path]:
    """The checkpoint to resume from (checked against the data and flags) or None, and the output folder."""
    resume, output_dir = args.resume, args.output_dir
    if args.auto_resume:
        if output_dir is None:
            raise UserError("--auto-resume needs --output-dir: the folder where a restarted job finds its checkpoint")
        if resume is None and (output_dir / CHECKPOINT_NAME).exists():
            resume = output_dir / CHECKPOINT_NAME
    if resume is not None:
        state = load_checkpoint(resume)
        if state["classes"] != split.classes:
            raise UserError(f"{resume} was trained on classes {state['classes']}, the data has {split.classes}")
        if state["world_size"] != world_size:
            raise UserError(f"{resume} was made by {state['world_size']} process(es); resume with as many")
        check_same_recipe(resume, state["args"], args)
        return resume, output_dir or resume.parent
    if output_dir is None:
        return None, Path("runs") / f"{args.script}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (output_dir / "metrics.jsonl").exists():
        raise UserError(
            f"{output_dir} already holds a run: continue it with --auto-resume, or choose another --output-dir"
        )
    return None, output_dir


# The flags that decide what a run computes: a resumed run must keep them, or its epochs would follow two
# different recipes (a new --epochs, say, would bend the learning-rate schedule half way). Speed flags (--amp,
# --channels-last, --workers, --device, ...) may change: they change rounding, not the recipe.
RECIPE_FLAGS = (
    "model", "epochs", "batch_size", "lr", "lrf", "opt", "momentum", "weight_decay", "warmup_epochs", "accumulate",
    "label_smoothing", "mixup_alpha", "cutmix_alpha", "auto_augment", "random_erase", "class_weights", "model_ema",
    "ema_decay", "seed", "val_rate", "img_size", "freeze_layers", "sync_bn",
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
