"""The record a run leaves beside its weights (its args.json, or its checkpoint's "args"), found from any of its
weights files: which network they are, for the one line that says so when they do not fit another."""

import contextlib
from pathlib import Path

from multi_train_utils.checkpoint import CHECKPOINT_NAME
from read_back import read_json, safe_load
from run.config import Config
from utils import UserError


def run_file(weights: Path, name: str) -> Path | None:
    """A file the run wrote, found beside the weights (checkpoint.pth) or one folder up (weights/best.pth)."""
    folders = (weights.parent, weights.parent.parent)
    return next((folder / name for folder in folders if (folder / name).is_file()), None)


def recorded_model(weights: Path) -> tuple[str, str] | None:
    """The --model of the run that saved `weights`, and where it is recorded; None where nothing (undamaged) says."""
    args_file = run_file(weights, "args.json")
    try:
        data = safe_load(weights, "weights file") if args_file is None else {}
        record, where, _ = record_beside(weights, args_file, data if isinstance(data, dict) else {})
    except UserError:  # a damaged record says nothing here: the refusal that asked stands as it is
        return None
    model = record.get("model") if isinstance(record, dict) else None
    return (model, where) if isinstance(model, str) else None


@contextlib.contextmanager
def of_their_model(weights: Path, model: str, fix: str, recorded: tuple[str, str] | None = None):
    """Inside, `weights` are loaded into `model`. Where they do not fit (a UserError) and their run recorded another
    --model (`recorded`, else recorded_model's), the error names the two, and `fix` ({theirs}, {model}) what to do."""
    try:
        yield
    except UserError:
        theirs, where = recorded or recorded_model(weights) or (model, None)
        if theirs == model:
            raise
        raise UserError(f"weights file {weights} holds {theirs}'s weights ({where} says --model {theirs}), which do "
                        f"not fit {model} (--model): " + fix.format(theirs=theirs, model=model)) from None  # fmt: skip


def record_beside(weights: Path, args_file: Path | None, checkpoint: dict) -> tuple[dict, str, str | None]:
    """The flags of the run that saved `weights`, where they were read, and the warning to give once the weights have
    loaded (or None): from its args.json (`args_file`), else `checkpoint`'s record, else its run folder's checkpoint
    (said), else none (the defaults, named)."""
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
