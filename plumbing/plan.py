"""The checked plan: what a run decides from its configuration before any training process starts.

`prepare` checks the input (the data, the weights, a checkpoint to resume, the output folder), makes the demo data,
splits the dataset, takes the output folder for this run (one run per folder: hold_run_folder) and returns a Plan:
everything the training loop needs to know that the flags alone do not say. Mistakes end here, in one line.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from filelock import BaseFileLock, FileLock, Timeout

from model import create_model, load_weights, weights_file
from multi_train_utils.distributed_utils import check_backend, launcher_environment
from my_dataset import DataSplit, read_split_data, split_fingerprint
from plumbing.checkpoint import CHECKPOINT_NAME, load_checkpoint
from plumbing.config import Config
from plumbing.demo_data import DEMO_DATA_PATH, make_demo_data
from utils import UserError, check_writable, describe


@dataclass(frozen=True)
class Plan:
    """What prepare decided: the data folder and its split, the weights to start from, the checkpoint to resume
    (None for a new run) and the folder the run writes to."""

    data_path: Path
    split: DataSplit
    output_dir: Path
    weights: Path | None = None
    resume: Path | None = None


def prepare(config: Config, world_size: int) -> Plan:
    """Check the input and make the one-time decisions that need no process group, for `world_size` processes.

    Makes the demo data, splits the dataset (checking every image can be read), finds the weights file, decides
    whether the run resumes (on the same split) and where it writes, and holds that folder for the process that
    writes there; raises UserError for bad input or a folder another live run holds.
    """
    check_backend(config.dist_backend)  # nccl where this torch has none (Windows, macOS): said before any worker
    data_path = config.data_path or (DEMO_DATA_PATH if config.demo else None)
    if data_path is None:
        raise UserError("no data: give --data-path FOLDER (one sub-folder per class) or --demo")
    if config.demo:
        make_demo_data(data_path)
    split = read_split_data(data_path, config.val_rate, config.seed, verify_images=True)
    check_split(config, split, data_path, world_size)
    weights = None
    if config.weights is not None:
        weights = weights_file(config.weights, config.model)  # `imagenet`: downloaded here, before any worker starts
        # refuse an unusable file before starting
        load_weights(create_model(len(split.classes), config.model), weights, name=config.model)
    resume, output_dir = resume_and_output(config, split, Path(data_path), world_size)
    check_writable(output_dir)
    if (launcher_environment() or {}).get("rank", 0) == 0:  # under torchrun every rank prepares; rank 0 writes
        hold_run_folder(output_dir)  # before looking at what the folder holds: another live run may be writing it
    if resume is None and (output_dir / "metrics.jsonl").exists():
        raise UserError(
            f"{output_dir} already holds a run: continue it with --auto-resume, or choose another --output-dir"
        )
    return Plan(Path(data_path), split, output_dir, weights, resume)


def check_split(config: Config, split: DataSplit, data_path: Path, world_size: int) -> None:
    if split.given and config.val_rate != Config.default("val_rate"):
        if (launcher_environment() or {}).get("rank", 0) == 0:  # under torchrun every rank prepares: say it once
            print(f"note: --val-rate {config.val_rate} is ignored: {data_path} holds train/ and val/, used as given")
    if split.unreadable and config.strict_images:
        raise UserError(f"{len(split.unreadable)} unreadable image(s) (--strict-images): {describe(split.unreadable)}")
    if config.num_classes is not None and config.num_classes != len(split.classes):
        raise UserError(
            f"--num-classes {config.num_classes} but {data_path} has {len(split.classes)} class folders: "
            + ", ".join(split.classes)
        )
    per_process = len(split.train_images) // world_size
    if per_process < config.batch_size:
        raise UserError(
            f"--batch-size {config.batch_size} is larger than the {per_process} training images each of "
            f"{world_size} process(es) gets: an epoch would have no step"
        )


RUN_LOCK = ".run.lock"  # in a run's folder: held by the process that writes the run's files, while it lives
held_run_folders: dict[Path, BaseFileLock] = {}  # this process's, kept here (not in the Plan, which is pickled)


def hold_run_folder(folder: Path) -> None:
    """Make `folder` if need be and hold its lock until this process exits, without waiting; UserError if another
    live run holds it. The OS lock (flock, or msvcrt on Windows) ends with its process: a crash leaves none."""
    if folder.resolve() in held_run_folders:
        return  # this process holds it already (a script's main called twice in one process, as tests do)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / RUN_LOCK, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(
            f"{folder} is in use by another run (which holds {folder / RUN_LOCK}): wait for that run to end, or "
            "choose another --output-dir"
        ) from None
    held_run_folders[folder.resolve()] = lock


def resume_and_output(config: Config, split: DataSplit, data_path: Path, world_size: int) -> tuple[Path | None, Path]:
    """The checkpoint to resume from (checked against the data, its split and the flags) or None, and the output
    folder."""
    resume, output_dir = config.resume, config.output_dir
    if config.auto_resume:
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
        check_same_recipe(resume, state["args"], config)
        check_same_split(resume, state["args"].get("split"), split_fingerprint(split, data_path))
        return resume, output_dir or resume.parent
    return None, output_dir or Path("runs") / f"{config.script}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_same_recipe(checkpoint: Path, saved: dict, config: Config) -> None:
    """UserError naming every recipe field (Config.recipe_fields) whose value differs from the one the checkpoint's
    run used: a resumed run must keep them, or its epochs would follow two different recipes (a new --epochs, say,
    would bend the learning-rate schedule half way). Speed flags (--amp, --workers, --device, ...) may change: they
    change rounding, not the recipe."""
    changed = [
        f"--{name.replace('_', '-')} {saved[name]} (not {getattr(config, name)})"
        for name in Config.recipe_fields()
        if name in saved and saved[name] != getattr(config, name)
    ]
    if changed:
        raise UserError(
            f"{checkpoint} was trained with {', '.join(changed)}: resume with the run's own flags, or start a "
            f"new run from its weights (--weights {checkpoint.parent / 'weights' / 'best.pth'})"
        )


def check_same_split(checkpoint: Path, saved: dict | None, now: dict) -> None:
    """UserError saying which images differ from those of the checkpoint's run (`saved`, split_fingerprint's
    record): a resumed run must train and validate on the same images, or validation images could become
    training ones half way. A checkpoint of a run that recorded none (older runs) is accepted."""
    if saved is None:
        return
    changed = []
    for subset, name in (("train", "training"), ("val", "validation")):
        then_count, now_count = saved[f"{subset}_images"], now[f"{subset}_images"]
        if saved[f"{subset}_sha256"] == now[f"{subset}_sha256"]:
            continue
        changed.append(
            f"{now_count} {name} images where the run had {then_count}"
            if now_count != then_count
            else f"{now_count} {name} images, not all the run's"
        )
    if changed:
        best = checkpoint.parent / "weights" / "best.pth"
        raise UserError(
            f"{checkpoint} was trained on another split of the data: {'; '.join(changed)}; resume with the run's "
            f"data, or start a new run from its weights (--weights {best})"
        )
