"""Loading a trained run's model for inference, as predict.py and evaluate.py do.

A run folder holds what inference needs besides the weights: class_indices.json (the class names) and args.json
(the image size, batch size, precision and data split the run used). Given any weights file of a run, both are found
beside it or one folder up; a checkpoint.pth carries them itself.
"""

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from dataset.transforms import val_transform
from machine import use_cores
from model import create_model, head_classes, load_weights, read_state_dict
from multi_train_utils.checkpoint import CHECKPOINT_NAME
from multi_train_utils.stop_and_resume import ignore_stop_signals
from my_dataset import MyDataSet
from read_back import advice, read_json, safe_load
from recipe.config import Config
from recipe.precision import Compute, choose_compute
from utils import UserError, number, positive_int, warn


@dataclass
class TrainedModel:
    """A network with a run's weights, in eval mode on its device, and what is known about the run."""

    model: nn.Module
    device: torch.device
    compute: Compute  # the run's precision and memory layout (--amp, --channels-last)
    classes: list[str]
    run: Config  # the run's configuration (args.json or the checkpoint's "args"; the defaults when neither is found)
    run_folder: Path

    def setting(self, name: str, given):
        """`given` (a flag of this command) when set, else the run's `name`."""
        return given if given is not None else getattr(self.run, name)


def run_file(weights: Path, name: str) -> Path | None:
    """A file the run wrote, found beside the weights (checkpoint.pth) or one folder up (weights/best.pth)."""
    return next(
        (folder / name for folder in (weights.parent, weights.parent.parent) if (folder / name).is_file()), None
    )


def run_folder(weights: Path) -> Path:
    """The run folder: the one that holds weights/ for best.pth, last.pth ..., else the weights' own folder."""
    return weights.parent.parent if weights.parent.name == "weights" else weights.parent


def recorded_model(weights: Path) -> tuple[str, str] | None:
    """The --model of the run that saved `weights`, and where it is recorded (where run_record finds the run's
    flags); None where nothing says (or the record is damaged)."""
    args_file = run_file(weights, "args.json")
    try:
        data = safe_load(weights, "weights file") if args_file is None else {}
        record, where, _ = run_record(weights, args_file, data if isinstance(data, dict) else {})
    except UserError:  # a damaged record says nothing here: the refusal that asked stands as it is
        return None
    model = record.get("model") if isinstance(record, dict) else None
    return (model, where) if isinstance(model, str) else None


@contextlib.contextmanager
def of_their_model(weights: Path, model: str, fix: str, recorded: tuple[str, str] | None = None):
    """Inside, the state dict read from `weights` is loaded into `model`. If it does not fit (a UserError) and their
    run recorded another --model (`recorded`, else recorded_model's), the error names the two instead, and what to
    do: `fix`, with {theirs} and {model} for their model and `model`."""
    try:
        yield
    except UserError:
        theirs, where = recorded or recorded_model(weights) or (model, None)
        if theirs == model:
            raise
        raise UserError(
            f"weights file {weights} holds {theirs}'s weights ({where} says --model {theirs}), which do not fit "
            f"{model} (--model): " + fix.format(theirs=theirs, model=model)
        ) from None


def class_names(indices, path: Path) -> list[str]:
    """["daisy", "dandelion", ...] from class_indices.json's {"0": "daisy", "1": "dandelion", ...}."""
    if (
        not isinstance(indices, dict)
        or not indices
        or set(indices) != {str(i) for i in range(len(indices))}
        or not all(isinstance(name, str) for name in indices.values())
    ):
        raise UserError(f'{path} is not a class index file such as {{"0": "daisy", "1": "dandelion"}}')
    return [indices[str(i)] for i in range(len(indices))]


def load_trained_model(
    weights: Path, class_indices: Path | None, device: torch.device, architecture: str | None = None
) -> TrainedModel:
    """The network of a weights file (best.pth, last.pth, model-N.pth or a run's checkpoint.pth) with its class
    names.

    Class names come from `class_indices` if given, else from the run's class_indices.json, else from the
    checkpoint's "classes"; the run's flags from its args.json, else from the checkpoint's "args". The weights must
    fit exactly: `architecture` if given, else the run's --model (ResNet-34 for runs that do not say), with one
    output per class name.
    """
    state_dict = read_state_dict(weights)
    indices_file = class_indices or run_file(weights, "class_indices.json")
    args_file = run_file(weights, "args.json")
    checkpoint = {}
    if indices_file is None or args_file is None:  # read the file again only when needed: a checkpoint is large
        data = safe_load(weights, "weights file")
        checkpoint = data if isinstance(data, dict) and "model" in data else {}

    if indices_file is not None:
        classes, classes_from = class_names(read_json(indices_file, "class index file"), indices_file), indices_file
    elif isinstance(checkpoint.get("classes"), list):
        classes, classes_from = checkpoint["classes"], f"checkpoint {weights}"
    else:
        raise UserError(
            f"no class names for {weights}: no class_indices.json beside it or in its run folder; "
            "pass --class-indices RUN/class_indices.json"
        )
    run_args, args_from, note = run_record(weights, args_file, checkpoint)
    if not isinstance(run_args, dict):
        raise UserError(f"{args_from} does not hold the flags of a run (a JSON object)")

    run = Config.from_record(run_args, args_from)
    recorded = args_file is not None or run_args  # else the run is unknown: the defaults
    named_by = "--model" if architecture else f"the --model of {args_from}" if recorded else "the default --model"
    architecture = architecture or run.model
    head = head_classes(state_dict, architecture)
    if head is not None and head != len(classes):
        raise UserError(
            f"weights file {weights} has a head for {head} classes, "
            f"but {classes_from} names {len(classes)}: {', '.join(classes)}"
        )
    model = create_model(len(classes), architecture)
    their_model = (run_args["model"], args_from) if isinstance(run_args.get("model"), str) else None
    fix = "leave out --model (the run's {theirs} is used), or give weights of a {model} run"
    with (
        of_their_model(weights, architecture, fix, their_model),
        advice(f"{architecture} is {named_by} (--model NAME says which)"),
    ):
        load_weights(model, state_dict, strict=True, name=architecture, what=f"weights file {weights}")
    # Compute as the run validated: the same precision gives the same predictions, not just nearly the same.
    # (Weights whose run is unknown, or recorded "auto" before runs recorded what auto chose: float32 NCHW.)
    compute = choose_compute(run.amp, run.channels_last, device)[0] if run_args else Compute()
    model = model.to(device, memory_format=compute.memory_format).eval()
    if note is not None:  # (after the weights loaded: a refusal is one line)
        warn(note)
    return TrainedModel(model, device, compute, classes, run, run_folder(weights))


def run_record(weights: Path, args_file: Path | None, checkpoint: dict) -> tuple[dict, str, str | None]:
    """The flags of the run that saved `weights`, where they were read, and the warning to give once the weights
    have loaded (None: none): its args.json (`args_file`); else the record in `checkpoint`, where `weights` is one;
    else the record in the checkpoint.pth of its run folder (args.json is gone: said); else none (the defaults
    taken instead: named)."""
    if args_file is not None:
        return read_json(args_file, "run flags file"), f"run flags file {args_file}", None
    if "args" in checkpoint:
        return checkpoint["args"], f"checkpoint {weights}", None
    saved = run_file(weights, CHECKPOINT_NAME)
    data = safe_load(saved, "checkpoint") if saved is not None and saved != weights else None
    if isinstance(data, dict) and isinstance(data.get("args"), dict):
        said = f"no args.json beside {weights} or in its run folder: the run's flags are read from {saved}"
        return data["args"], f"checkpoint {saved}", said
    defaults = ", ".join(f"--{name.replace('_', '-')} {Config.default(name)}" for name in ("img_size", "model", "amp"))
    said = (
        f"no record of the flags of the run that saved {weights} (no args.json or {CHECKPOINT_NAME} beside it or in "
        f"its run folder): taking the defaults where not given ({defaults}); give the run's own where they differ"
    )
    return {}, "the defaults", said


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of predict.py and evaluate.py alike: which weights, their class names, how to run them."""
    parser.add_argument(
        "--weights",
        type=Path,
        required=True,
        help="a run's weights: weights/best.pth, weights/last.pth, weights/model-N.pth or checkpoint.pth",
    )
    add_run_overrides(parser)
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"images per forward pass (default: the run's, else {Config.default('batch_size')})",
    )
    parser.add_argument(
        "--workers",
        type=number(int, 0),
        help="image loader processes (default: as for training, see machine.py core_budget)",
    )
    parser.add_argument(
        "--device", help="cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else mps on a Mac, else cpu)"
    )


def add_run_overrides(parser: argparse.ArgumentParser) -> None:
    """The flags that override what a run's files say: its network, its class names and its image size."""
    parser.add_argument(
        "--model",
        help="the network the weights are for, torchvision's name or timm/NAME (default: the run's, else resnet34)",
    )
    parser.add_argument(
        "--class-indices",
        type=Path,
        help="class_indices.json (default: the run's, beside the weights or one folder up, else the checkpoint's)",
    )
    parser.add_argument(
        "--img-size",
        type=positive_int,
        help=f"the crop size the run trained with (default: the run's, else {Config.default('img_size')})",
    )


def image_loader(
    trained: TrainedModel, images: list, labels: list, shard=None, processes_here: int = 1, *,
    img_size: int | None = None, batch_size: int | None = None, workers: int | None = None,
) -> DataLoader:  # fmt: skip
    """Batches of (images as the run validated them: resized and centre-cropped, labels), in the given order;
    with `shard` (val_shard's positions), those of its images alone, for one of `processes_here` processes
    sharing this machine's cores. `img_size`, `batch_size`, `workers`: the tool's flags (None: the run's, and as
    many workers as a training process has)."""
    img_size = trained.setting("img_size", img_size)
    batch_size = trained.setting("batch_size", batch_size)
    workers = use_cores(trained.device, processes_here, batch_size, workers)  # as a training process has
    return DataLoader(
        MyDataSet(images, labels, val_transform(img_size)),
        batch_size=batch_size,
        sampler=shard,
        num_workers=workers,
        pin_memory=trained.device.type == "cuda",
        worker_init_fn=ignore_stop_signals,  # a stop signal is for the process they load for to act on
    )
