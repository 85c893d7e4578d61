"""What a training run is, whatever starts its processes: the flags, the checks before any process starts, and
`train`, which every launch script calls in each of its processes.

The launch scripts differ only in how they start processes and join them into a group; from `train` on, one
process and eight run the same code, with rank 0 alone printing and writing files.
"""

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from torch.optim import lr_scheduler
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from checkpoint import CHECKPOINT_NAME, load_checkpoint, restore_rng, save_atomically, training_state
from model import create_model, freeze_all_but_head, load_weights
from multi_train_utils.distributed_utils import barrier, broadcast_object, get_world_size, is_main_process
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import evaluate, train_one_epoch
from my_dataset import MyDataSet, SeededBatchSampler, train_transform, val_transform
from utils import (
    DEMO_DATA_PATH,
    DataSplit,
    UserError,
    available_cores,
    make_demo_data,
    plain_args,
    read_split_data,
    write_atomically,
    write_class_indices,
    write_json,
)

# --demo trains on generated data with settings that finish in a few minutes on a laptop CPU; any flag given
# on the command line still wins.
DEMO_DEFAULTS = {"epochs": 10, "img_size": 64, "lr": 0.01}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has one worth showing (not None, not an off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors in one line, like every other user error here."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def number(kind, minimum, maximum=None, above_minimum=False):
    """An argparse type: a number of `kind` within [minimum, maximum] (or above minimum)."""

    def parse(text):
        value = kind(text)
        if value < minimum or (above_minimum and value == minimum) or (maximum is not None and value > maximum):
            bound = f"greater than {minimum}" if above_minimum else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and at most {maximum}" if maximum else ""))
        return value

    return parse


positive_int, positive_float = number(int, 1), number(float, 0, above_minimum=True)


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
        help="data loader processes per training process (default: this process's share of the CPU cores, at most 8)",
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
        "--weights", type=Path, help="initial weights: a torchvision ResNet-34 file or weights saved by these scripts"
    )
    model.add_argument(
        "--freeze-layers", action=argparse.BooleanOptionalAction, default=False, help="train only the final layer"
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

    if script != "train_single_gpu":
        dist = p.add_argument_group("distributed")
        dist.add_argument(
            "--sync-bn",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="synchronise BatchNorm statistics across processes",
        )
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
        args.output_dir = args.output_dir or args.resume.parent
    elif args.output_dir is None:
        args.output_dir = Path("runs") / f"{args.script}-{time.strftime('%Y%m%d-%H%M%S')}"
    elif (args.output_dir / "metrics.jsonl").exists():
        raise UserError(
            f"{args.output_dir} already holds a run: continue it with --auto-resume, or choose another --output-dir"
        )
    check_writable(args.output_dir)
    return split


def check_writable(folder: Path) -> None:
    """UserError unless `folder` can be created (or exists) and written to; creates nothing."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise UserError(f"cannot write the output folder {folder}: {error.strerror} ({existing})") from None


def describe(paths: list[str], shown: int = 5) -> str:
    return ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def default_workers(args) -> int:
    """This process's share of the cores, so loader workers of all local processes do not fight for them."""
    return max(1, min(8, available_cores() // args.local_world_size, args.batch_size))


def build_loaders(args, split, world_size: int, rank: int):
    train_set = MyDataSet(split.train_images, split.train_labels, train_transform(args.img_size))
    val_set = MyDataSet(split.val_images, split.val_labels, val_transform(args.img_size))
    # One sampler for every launch mode: a world of one is DistributedSampler(num_replicas=1). Shards are disjoint
    # (drop_last: the sampler drops the tail instead of repeating images to even them out), and incomplete
    # batches are dropped, so every step of every rank has the same batch size.
    shard = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    batches = SeededBatchSampler(BatchSampler(shard, args.batch_size, drop_last=True), args.seed)
    workers = default_workers(args) if args.workers is None else args.workers
    common = {"num_workers": workers, "persistent_workers": workers > 0, "pin_memory": args.device.startswith("cuda")}
    train_loader = DataLoader(train_set, batch_sampler=batches, **common)
    # Validation: rank r takes images r, r+W, r+2W, ...: disjoint, nothing padded, each image counted once.
    val_loader = DataLoader(
        val_set, batch_size=args.batch_size, sampler=range(rank, len(val_set), world_size), **common
    )
    return train_loader, val_loader, workers


def say(*message) -> None:
    if is_main_process():
        print(*message, flush=True)


def build_model(args, num_classes: int, device: torch.device):
    """ResNet-34 with its initial weights, on `device`; in DDP wrapped (and SyncBN-converted when asked).

    Returns (the model to train, the same model without the DDP wrapper, for evaluating and saving).
    """
    torch.manual_seed(args.seed)  # the same initial weights in every process; DDP also broadcasts rank 0's
    model = create_model(num_classes)
    if args.weights is not None:
        report = load_weights(model, args.weights)
        say(f"Weights from {args.weights}: {report.summary()}")
    if args.freeze_layers:
        freeze_all_but_head(model)
    model.to(device)
    if not args.distributed:
        return model, model
    if args.sync_bn and not args.freeze_layers:  # training the head alone, synchronised statistics buy nothing
        model = convert_sync_batchnorm(model, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, model


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
    if device.type == "cpu" and args.local_world_size > 1:  # processes on one machine share its cores
        torch.set_num_threads(max(1, available_cores() // args.local_world_size))
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

    model, model_without_ddp = build_model(args, num_classes, device)
    optimizer, scheduler = build_optimizer(args, model)
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
        restore_rng(state)
        start_epoch, best_acc = state["epoch"] + 1, state["best_acc"]
        say(f"Resuming from {args.resume}: epoch {start_epoch} of {args.epochs}, best val acc so far {best_acc:.3f}")
        if is_main_process():
            keep_metrics_before(output_dir / "metrics.jsonl", start_epoch)

    writer = SummaryWriter(str(output_dir / "tb"), purge_step=start_epoch) if is_main_process() else None
    if is_main_process():
        say(f'Output: {output_dir}  (TensorBoard: tensorboard --logdir "{output_dir / "tb"}")')
        write_json(output_dir / "args.json", plain_args(args))

    metrics = {}
    for epoch in range(start_epoch, args.epochs):
        train_loader.batch_sampler.set_epoch(epoch)  # a new shuffle (and new augmentation) every epoch
        epoch_lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        train_loss, train_images = train_one_epoch(model, optimizer, train_loader, device, epoch)
        train_seconds = time.perf_counter() - start
        scheduler.step()
        confusion = evaluate(model_without_ddp, val_loader, device, num_classes)
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
        }
        improved, best_acc = val_acc > best_acc, max(best_acc, val_acc)
        if is_main_process():
            say(
                f"[epoch {epoch}] train loss {train_loss:.3f}  val acc {val_acc:.3f} ({val_correct}/{val_total})  "
                f"lr {epoch_lr:.2e}  {epoch_seconds:.1f} s, {metrics['train_images_per_sec']:.1f} img/s"
            )
            for tag, value in (("loss", train_loss), ("accuracy", val_acc), ("learning_rate", epoch_lr)):
                writer.add_scalar(tag, value, epoch)
            with open(output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            state_dict = model_without_ddp.state_dict()
            save_atomically(state_dict, weights_dir / f"model-{epoch}.pth")
            if improved:
                save_atomically(state_dict, weights_dir / "best.pth")
            # Last, so that a checkpoint never claims an epoch whose outputs are not all written.
            state = training_state(
                epoch, model_without_ddp, optimizer, scheduler, None, best_acc, split.classes, world_size, args
            )
            save_atomically(state, output_dir / CHECKPOINT_NAME)
        barrier()  # no rank starts the next epoch before this one's checkpoint is on disk
    if writer is not None:
        writer.close()
    say(f"Done: best val acc {best_acc:.3f}; weights in {weights_dir}")
    return metrics


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["epoch"] < epoch]
        write_atomically(path, lambda f: f.writelines(lines))


def cosine_factor(epoch: int, epochs: int, lrf: float) -> float:
    """Learning-rate factor: 1 at the first epoch, falling along a half cosine to lrf after the last."""
    return ((1 + math.cos(epoch * math.pi / epochs)) / 2) * (1 - lrf) + lrf
