"""Saving and loading the full training state, so that a run killed at any moment continues where it stopped.

A checkpoint holds only tensors and plain Python data, so it loads with torch.load(weights_only=True): loading
one never runs code. It is written atomically (temporary file in the same folder, fsync, rename): a crash while
writing leaves the previous checkpoint in place, never half a file.
"""

from pathlib import Path

import torch

from read_back import NUMBER, misfits, safe_load
from utils import UserError, in_brief, write_atomically

CHECKPOINT_NAME = "checkpoint.pth"
CHECKPOINT_KEYS = {"epoch", "model", "optimizer", "scheduler", "best_acc", "classes", "world_size", "args"}
# What each entry of a checkpoint holds (read_back.misfits' shapes): what training_state writes, and what
# stop_and_resume's save_step adds ("midway"); a run's record ("args") with its split (split_fingerprint's).
SPLIT = {"train_images": int, "train_sha256": str, "val_images": int, "val_sha256": str}
CHECKPOINT_SHAPE = {
    "epoch": int,
    "model": dict,
    "optimizer": dict,
    "scheduler": dict,
    "scaler": (dict, type(None)),
    "ema": (dict, type(None)),
    "best_acc": NUMBER,
    "classes": [str],
    "world_size": int,
    "args": {"split": (SPLIT, type(None))},
    "midway": ({"step": int, "totals": [NUMBER], "lr": NUMBER, "seconds": (NUMBER, type(None))}, type(None)),
}


def save_atomically(obj, path) -> None:
    """torch.save to `path`; readers (and crashes) see either the old file or the complete new one. If it cannot
    be written (a full disk, ...), OutputError, with `path` untouched."""
    size = tensor_bytes(obj)
    write_atomically(path, lambda f: torch.save(obj, f), binary=True, size=size)


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in `obj` (nested in dicts, lists and tuples): about the size of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(tensor_bytes(item) for item in obj) if isinstance(obj, list | tuple) else 0


def training_state(epoch, model, training, best_acc, classes, world_size, record: dict) -> dict:
    """Everything needed to continue after `epoch`, as tensors and plain data: `model` (the network without its
    DDP or compilation wrapper), what `training` (a train_eval_utils.Training) steps and averages, and `record`,
    the run's configuration as in args.json.

    No random generator's state: each training step draws from a seed of its own (EpochSteps.seed_random_draws),
    so a resumed run needs none, on any number of devices. (Checkpoints of earlier versions hold one, "rng": it
    is not read.)"""
    return {
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "ema": training.ema.state_dict() if training.ema is not None else None,
        "best_acc": best_acc,
        "classes": list(classes),
        "world_size": world_size,
        "args": record,
    }


def load_checkpoint(path) -> dict:
    """Read a checkpoint written by save_atomically(training_state(...)); UserError if it is not one, or if an
    entry is not what the scripts write there (a damaged or hand-edited file)."""
    state = safe_load(path, "checkpoint", if_damaged=start_anew(path))
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise UserError(f"{path} is not a training checkpoint of these scripts (weights only? use --weights)")
    damage = misfits(state, CHECKPOINT_SHAPE)
    if damage:
        raise UserError(f"checkpoint {path} is damaged ({'; '.join(damage)}): {start_anew(path)}")
    return state


def start_anew(path) -> str:
    """What to do with a checkpoint that cannot be resumed."""
    weights = Path(path).parent / "weights" / "best.pth"
    return f"restore it from a backup, or start a new run from its weights (--weights {weights})"


def restore(state: dict, model, training, path=None) -> tuple[int, float]:
    """Put a checkpoint's state (read from `path`) back into the model and what `training` steps; returns (the
    first epoch to train, the best validation accuracy so far). Where in that epoch a run stopped at a step
    continues is stop_and_resume's (Midway). UserError if a part does not fit (a checkpoint edited by hand).

    A checkpoint saved without float16's gradient scaler (bfloat16 or float32: its scaler was off, its state
    empty) resumes with one just as well: the scaler starts afresh."""
    parts = {"model": model, "optimizer": training.optimizer, "scheduler": training.scheduler}
    if state.get("scaler") and training.scaler is not None:  # {}: saved with the scaler off
        parts["scaler"] = training.scaler
    if training.ema is not None:
        parts["ema"] = training.ema
    for part, target in parts.items():
        try:
            target.load_state_dict(state[part])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:  # torch's, by part
            reason = in_brief(str(error), 200)
            raise UserError(
                f"checkpoint {path}: its {part} does not fit this run's ({reason}): {start_anew(path)}"
            ) from None
    return state["epoch"] + 1, state["best_acc"]


def save_epoch(output_dir: Path, epoch: int, weights: dict, best: dict | None, state: dict, keep: bool = False) -> None:
    """What an epoch leaves on disk: its weights as weights/last.pth (and as weights/model-N.pth when `keep`),
    `best` as weights/best.pth when the epoch improved on the best validation accuracy, and the checkpoint,
    last, so that a checkpoint never claims an epoch whose outputs are not all written.

    Weights are saved as CPU tensors, so that they load on a machine without a GPU without a map_location.
    """
    on_cpu = lambda tensors: {name: tensor.cpu() for name, tensor in tensors.items()}  # noqa: E731
    weights = on_cpu(weights)
    save_atomically(weights, output_dir / "weights" / "last.pth")
    if keep:
        save_atomically(weights, output_dir / "weights" / f"model-{epoch}.pth")
    if best is not None:
        save_atomically(on_cpu(best), output_dir / "weights" / "best.pth")
    save_atomically(state, output_dir / CHECKPOINT_NAME)
