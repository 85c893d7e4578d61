"""A trained run's model for predict.py and evaluate.py, with its class_indices.json and args.json (beside or above)."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from dataset.transforms import val_transform
from machine import use_cores
from multi_train_utils.train_eval_utils import Choice
from my_dataset import MyDataSet, ignore_stop_signals
from network.architectures import create_model
from network.weights import head_classes, load_weights, read_state_dict
from read_back import advice, read_json, safe_load
from run.config import Config
from run.records import of_their_model, record_beside, run_file
from utils import UserError, number, positive_int, warn


@dataclass
class TrainedModel:
    """A network with a run's weights, in eval mode on its device, and what is known about the run."""

    model: nn.Module
    device: torch.device
    choice: Choice  # the run's precision and memory layout (--amp, --channels-last)
    classes: list[str]
    run: Config  # args.json or the checkpoint's "args"; the defaults when neither is found
    run_folder: Path

    def setting(self, name: str, given):
        """`given` (a flag of this command) when set, else the run's `name`."""
        return given if given is not None else getattr(self.run, name)


def load_trained_model(weights: Path, class_indices: Path | None, device: torch.device,
                       architecture: str | None = None) -> TrainedModel:  # fmt: skip
    """The network of a weights file (best.pth, last.pth, model-N.pth or checkpoint.pth), with class names from
    `class_indices`, the run's or the checkpoint's; the weights must fit `architecture` (default: the run's --model)."""
    state_dict = read_state_dict(weights)
    indices_file = class_indices or run_file(weights, "class_indices.json")
    args_file = run_file(weights, "args.json")
    checkpoint = {}
    if indices_file is None or args_file is None:  # read again only when needed: a checkpoint is large
        data = safe_load(weights, "weights file")
        checkpoint = data if isinstance(data, dict) and "model" in data else {}
    if indices_file is not None:
        indices, classes_from = read_json(indices_file, "class index file"), indices_file  # a dict
        valid = indices and set(indices) == {str(i) for i in range(len(indices))}
        if not valid or not all(isinstance(name, str) for name in indices.values()):
            raise UserError(f'{indices_file} is not a class index file such as {{"0": "daisy", "1": "dandelion"}}')
        classes = [indices[str(i)] for i in range(len(indices))]
    elif isinstance(checkpoint.get("classes"), list):
        classes, classes_from = checkpoint["classes"], f"checkpoint {weights}"
    else:
        raise UserError(f"no class names for {weights}: no class_indices.json beside it or in its run folder; "
                        "pass --class-indices RUN/class_indices.json, and the run's --model and --img-size where "
                        "they are not the defaults")  # fmt: skip
    run_args, args_from, note = record_beside(weights, args_file, checkpoint)
    if not isinstance(run_args, dict):
        raise UserError(f"{args_from} does not hold the flags of a run (a JSON object)")
    run = Config.from_record(run_args, args_from)
    recorded = args_file is not None or run_args  # else the run is unknown: the defaults
    named_by = "--model" if architecture else f"the --model of {args_from}" if recorded else "the default --model"
    architecture = architecture or run.model
    head = head_classes(state_dict, architecture)
    if head is not None and head != len(classes):
        raise UserError(f"weights file {weights} has a head for {head} classes, "
                        f"but {classes_from} names {len(classes)}: {', '.join(classes)}")  # fmt: skip
    model = create_model(len(classes), architecture)
    their_model = (run_args["model"], args_from) if isinstance(run_args.get("model"), str) else None
    fix = "leave out --model (the run's {theirs} is used), or give weights of a {model} run"
    with (of_their_model(weights, architecture, fix, their_model),
          advice(f"{architecture} is {named_by} (--model NAME says which)")):  # fmt: skip
        load_weights(model, state_dict, strict=True, name=architecture, what=f"weights file {weights}")
    # As the run validated, for the same predictions; float32 NCHW for an unknown run, or one that recorded "auto"
    choice = Choice(run.amp if run.amp != "auto" else "off", bool(run.channels_last)) if run_args else Choice()
    model = model.to(device, memory_format=choice.memory_format).eval()
    if note is not None:  # (after the weights loaded: a refusal is one line)
        warn(note)
    folder = weights.parent.parent if weights.parent.name == "weights" else weights.parent
    return TrainedModel(model, device, choice, classes, run, folder)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", type=Path, required=True, help="a run's weights: weights/best.pth, weights/last.pth, "
                   "weights/model-N.pth or checkpoint.pth")  # fmt: skip
    add_run_overrides(p)
    p.add_argument("--batch-size", type=positive_int, help="images per forward pass (default: the run's, else "
                   f"{Config.default('batch_size')})")  # fmt: skip
    p.add_argument("--workers", type=number(int, 0),
                   help="image loader processes (default: as for training, see machine.py core_budget)")  # fmt: skip
    p.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: cuda when a GPU is visible, else mps on a Mac, "
                   "else cpu)")  # fmt: skip


def add_run_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="the network the weights are for, torchvision's name or timm/NAME (default: the "
                   "run's, else resnet34)")  # fmt: skip
    p.add_argument("--class-indices", type=Path, help="class_indices.json (default: the run's, beside the weights or "
                   "one folder up, else the checkpoint's)")  # fmt: skip
    p.add_argument("--img-size", type=positive_int, help="the crop size the run trained with (default: the run's, "
                   f"else {Config.default('img_size')})")  # fmt: skip


def image_loader(
    trained: TrainedModel, images: list, labels: list, shard=None, processes_here: int = 1, *,
    img_size: int | None = None, batch_size: int | None = None, workers: int | None = None,
) -> DataLoader:  # fmt: skip
    """Batches (images as the run validated them, labels) in order, or `shard`'s; the flags given override the run's."""
    img_size, batch_size = trained.setting("img_size", img_size), trained.setting("batch_size", batch_size)
    workers = use_cores(trained.device, processes_here, batch_size, workers)  # as a training process has
    # ignore_stop_signals: a stop signal is for the process they load for to act on
    return DataLoader(MyDataSet(images, labels, val_transform(img_size)), batch_size=batch_size, sampler=shard,
                      num_workers=workers, pin_memory=trained.device.type == "cuda",
                      worker_init_fn=ignore_stop_signals)  # fmt: skip
