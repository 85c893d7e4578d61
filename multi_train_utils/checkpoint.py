"""The training state saved atomically, tensors and plain data alone (loading runs no code): a killed run continues."""

import os
import shutil
from pathlib import Path

import torch

from read_back import NUMBER, WEIGHTS_FILE, misfits, safe_load, with_weights
from utils import UserError, atomic_file, in_brief, sync_folder, write_atomically, writing

CHECKPOINT_NAME = "checkpoint.pth"
CHECKPOINT_KEYS = {"epoch", "model", "optimizer", "scheduler", "best_acc", "classes", "world_size", "args"}
# What each entry holds (read_back.misfits' shapes): training_state's, and save_step's "midway".
SPLIT = {"train_images": int, "train_sha256": str, "val_images": int, "val_sha256": str}
CHECKPOINT_SHAPE = {
    "epoch": int, "model": dict, "optimizer": dict, "scheduler": dict, "scaler": (dict, type(None)),
    "ema": (dict, type(None)), "best_acc": NUMBER, "classes": [str], "world_size": int,
    "args": {"split": (SPLIT, type(None))},
    "midway": ({"step": int, "totals": [NUMBER], "lr": NUMBER, "seconds": (NUMBER, type(None))}, type(None)),
}  # fmt: skip


def save_atomically(obj, path) -> None:
    """torch.save to `path`, whole or not at all; OutputError if it cannot be written (on a full disk, its size)."""
    write_atomically(path, lambda f: torch.save(obj, f), binary=True, size=tensor_bytes(obj))


def tensor_bytes(obj) -> int:
    """The bytes of the tensors nested in `obj`: about the size of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(tensor_bytes(item) for item in obj) if isinstance(obj, list | tuple) else 0


def training_state(epoch, model, training, best_acc, classes, world_size, record: dict) -> dict:
    """All needed to continue after `epoch` (`model` unwrapped); no generator state: each step seeds its own draws."""
    return {
        "epoch": epoch, "model": model.state_dict(), "optimizer": training.optimizer.state_dict(),
        "scheduler": training.scheduler.state_dict(),
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "ema": training.ema.state_dict() if training.ema is not None else None,
        "best_acc": best_acc, "classes": list(classes), "world_size": world_size, "args": record,
    }  # fmt: skip


def load_checkpoint(path) -> dict:
    """Read a checkpoint; UserError if it is not one, or if an entry is not what the scripts write there."""
    state = safe_load(path, "checkpoint", if_damaged=start_anew(path))
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise UserError(f"{path} is not a training checkpoint of these scripts (weights only? use --weights)")
    state = with_weights(state, path)
    damage = misfits(state, CHECKPOINT_SHAPE)
    if damage:
        raise UserError(f"checkpoint {path} is damaged ({'; '.join(damage)}): {start_anew(path)}")
    return state


def start_anew(path) -> str:
    """What to do with a checkpoint that cannot be resumed."""
    weights = Path(path).parent / "weights" / "best.pth"
    return f"restore it from a backup, or start a new run from its weights (--weights {weights})"


def restore(state: dict, model, training, path=None) -> tuple[int, float]:
    """Put a checkpoint's state back: (the first epoch to train, the best val accuracy); UserError if a part misfits."""
    parts = {"model": model, "optimizer": training.optimizer, "scheduler": training.scheduler}
    if state.get("scaler") and training.scaler is not None:  # {}: saved with the scaler off, float16's starts afresh
        parts["scaler"] = training.scaler
    if training.ema is not None:
        parts["ema"] = training.ema
    for part, target in parts.items():
        try:
            target.load_state_dict(state[part])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:  # torch's, by part
            reason = f"its {part} does not fit this run's ({in_brief(str(error), 200)})"
            raise UserError(f"checkpoint {path}: {reason}: {start_anew(path)}") from None
    return state["epoch"] + 1, state["best_acc"]


# The parts whose weights an epoch keeps in files of their own, less a prefix: best.pth can be either file.
SHARED = {"model": "", "ema": "module."}


def save_epoch(output_dir: Path, epoch: int, state: dict, best: str | None = None, keep: bool = False) -> None:
    """An epoch's files from its checkpoint's `state` (CPU tensors), each weight serialised once, then linked; then the
    checkpoint, never naming a missing file; old files last (docs/performance.md, each weight written once)."""
    folder, state, named = output_dir / "weights", dict(state), {}
    for part, prefix in SHARED.items():
        if state.get(part) is None:
            continue
        tensors, named[part] = state[part], folder / f".{part}-{epoch}.pth"
        if part == "model":  # last.pth written first, the file a full disk's line names
            save_atomically(tensors, folder / "last.pth")
            link_or_copy(folder / "last.pth", named[part])
        else:
            weights = {key.removeprefix(prefix): v for key, v in tensors.items() if key.startswith(prefix)}
            save_atomically(weights, named[part])
        rest = {key: value for key, value in tensors.items() if not key.startswith(prefix)}  # the EMA's count
        state[part] = {WEIGHTS_FILE: f"weights/{named[part].name}", "prefix": prefix} | rest
    if keep:
        link_or_copy(named["model"], folder / f"model-{epoch}.pth")
    if best is not None:
        link_or_copy(named[best], folder / "best.pth")
    sync_folder(folder)  # the links on disk before the checkpoint names them
    save_atomically(state, output_dir / CHECKPOINT_NAME)
    for old in {path for part in SHARED for path in folder.glob(f".{part}-*.pth")} - set(named.values()):
        old.unlink(missing_ok=True)


def link_or_copy(source: Path, path: Path) -> None:
    """`path` made the file `source` atomically: a hard link, or a copy where the filesystem has none (FAT, exFAT)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with writing(path):
        try:
            tmp.unlink(missing_ok=True)
            os.link(source, tmp)
        except OSError:
            with atomic_file(path, binary=True) as copy, open(source, "rb") as original:
                shutil.copyfileobj(original, copy)
            return
        try:
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # still there if it already was `path` (rename does nothing then)
