"""The checked plan: what a run decides from its configuration before any training process starts.

`prepare` checks the input (the data, the weights, a checkpoint to resume, the output folder), makes the demo data,
splits the dataset, takes the output folder for this run (one run per folder: hold_run_folder) and returns a Plan:
everything the training loop needs to know that the flags alone do not say. Mistakes end here, in one line.
"""

import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dataset.demo import DEMO_DATA_PATH, make_demo_data
from dataset.folders import DataSplit, read_split_data, split_fingerprint
from dataset.image_check import ImageCheck
from model import check_input_size
from multi_train_utils.checkpoint import CHECKPOINT_NAME, load_checkpoint
from multi_train_utils.distributed_utils import check_backend, launcher_environment
from network.architectures import batch_statistics, create_model, random_draws
from network.weights import load_weights, read_state_dict, weights_file
from run.config import Config, admitted
from run.folder_lock import hold_run_folder
from run.metrics import METRICS_NAME, read_metrics
from run.records import of_their_model
from utils import UserError, check_writable, describe, printable, run_files_in


@dataclass(frozen=True)
class Plan:
    """What prepare decided: the data folder and its split, the weights to start from, the checkpoint to resume
    (None for a new run) and the folder the run writes to."""

    data_path: Path
    split: DataSplit
    output_dir: Path
    weights: Path | None = None
    resume: Path | None = None
    given: dict = field(default_factory=dict)  # the run's --batch-size and --lr, for `recipe_world_size` processes
    saved: dict | None = None  # the resumed checkpoint's record of its run (run_record), None for a new run

    @property
    def tracked_run(self) -> dict | None:
        """The resumed checkpoint's "tracked_run" (run/tracking.py), if it has one."""
        return self.saved.get("tracked_run") if self.saved else None


def prepare(config: Config, world_size: int) -> tuple[Config, Plan]:
    """Check the input and make the one-time decisions that need no process group, for `world_size` processes;
    returns the configuration to train with (`config`, or for a run resumed on another number of processes, its
    per-process batch and rate: per_process_recipe) and the Plan.

    Makes the demo data, splits the dataset (checking every image can be read, once per run: ImageCheck), finds
    the weights file, decides whether the run resumes (on the same split) and where it writes, and holds that
    folder for the process that writes there; raises UserError for bad input or a folder another live run holds.
    """
    check_backend(config.dist_backend)  # nccl where this torch has none (Windows, macOS): said before any worker
    check_input_size(config.model, config.img_size)  # a ViT at 48 px: one line, before any folder is made
    data_path = config.data_path or (DEMO_DATA_PATH if config.demo else None)
    if data_path is None:
        raise UserError("no data: give --data-path FOLDER (one sub-folder per class) or --demo")
    if config.demo:
        make_demo_data(data_path)
    folder = config.output_dir or (config.resume.parent if config.resume else None)  # the run's, if named already
    if folder is not None and printable(str(folder)) != str(folder):  # TensorBoard's writer encodes its path strictly
        raise UserError(f"output folder {folder} has a name that is not UTF-8, which TensorBoard cannot write into")
    check = ImageCheck(data_path, folder, shared=launcher_environment() is not None and world_size > 1)
    if check.shared:  # under torchrun every rank prepares: they share the image check
        check_writable(folder)  # the ranks meet there (a lock), before any of them writes the run's files
    split = read_split_data(data_path, config.val_rate, config.seed, verify_images=check)
    resume, output_dir, saved = resume_and_output(config, split, Path(data_path), world_size)
    config, given = per_process_recipe(config, saved, world_size, resume)
    check_split(config, split, data_path, world_size)
    weights = None
    if config.weights is not None:
        weights = weights_file(config.weights, config.model)  # `imagenet`: downloaded here, before any worker starts
        # refuse an unusable file before starting, and say what it holds for the model
        state_dict, model = read_state_dict(weights), create_model(len(split.classes), config.model)
        fix = "train {theirs} from them (--model {theirs}), or {model} from other weights (--weights imagenet, or none)"
        with of_their_model(weights, config.model, fix):  # (read first: a file that cannot be read is said as such)
            report = load_weights(model, state_dict, name=config.model, what=f"weights file {weights}")
        if first_rank():  # under torchrun every rank prepares: say it once
            print(f"Weights from {weights}: {report.summary()}", flush=True)
    check_writable(output_dir)
    if first_rank():  # under torchrun every rank prepares; rank 0 writes
        hold_run_folder(output_dir)  # before looking at what the folder holds: another live run may be writing it
    claim_run_folder(output_dir, resume, restart=config.auto_resume and resume is None)
    if resume is not None:
        read_metrics(output_dir / METRICS_NAME)  # a damaged record of the epochs refuses the resume before any write
    if first_rank():
        check.save(output_dir)  # the images' verdicts, for the next start of this run (a restart, a resume)
    return config, Plan(Path(data_path), split, output_dir, weights, resume, given, saved)


def check_split(config: Config, split: DataSplit, data_path: Path, world_size: int) -> None:
    if split.given and config.val_rate != Config.default("val_rate"):
        if first_rank():  # under torchrun every rank prepares: say it once
            print(f"note: --val-rate {config.val_rate} is ignored: {data_path} holds train/ and val/, used as given")
    if split.unreadable and config.strict_images:
        raise UserError(f"{len(split.unreadable)} unreadable image(s) (--strict-images): {describe(split.unreadable)}")
    if len(split.classes) < 2:  # one class: its loss is 0 from the first step, and nothing is learnt
        raise UserError(
            f"{data_path} has one class folder ({split.classes[0]}): a classifier needs at least 2 classes to tell "
            "apart, each a sub-folder of the data path"
        )
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


def first_rank() -> bool:
    """Whether this process is rank 0, before any process group exists: under torchrun every rank prepares, and
    rank 0 alone speaks and writes."""
    return (launcher_environment() or {}).get("rank", 0) == 0


# The files a run writes once an epoch has ended: a folder holding none of them holds nothing to keep
FINISHED_EPOCH_FILES = (METRICS_NAME, CHECKPOINT_NAME, "weights/*.pth")


def claim_run_folder(output_dir: Path, resume: Path | None, restart: bool) -> None:
    """Refuse, before any file is touched, a run that would write into another run's folder. A resume writes into
    its checkpoint's folder, or into one that holds no run's files (and says so). A new run writes into a folder
    that holds no finished epoch: what a start that ended before its first epoch did left there (its args.json,
    class_indices.json, tb/, tracked_run.json) holds nothing to keep, whatever ended it (a failure in the first
    step, a refusal on bad images, a stop), so the corrected command runs where it failed; a restart
    (--auto-resume finding no checkpoint) continues that start in its files (and its tracked run), a new run
    replaces them (and says so). Under torchrun every rank prepares and refuses alike, before any of them writes
    (the process group forms after prepare)."""
    if resume is not None and output_dir.resolve() == resume.parent.resolve():
        return
    found = run_files_in(output_dir)
    finished = [name for name in found if name in FINISHED_EPOCH_FILES]
    if finished or found and resume is not None:
        where = (
            f"resume {resume} in its own folder (leave out --output-dir) or into a new or empty one"
            if resume is not None
            else f"with no {CHECKPOINT_NAME} to continue from: choose another --output-dir"
            if restart
            else "continue it with --auto-resume, or choose another --output-dir"
        )
        raise UserError(f"{output_dir} already holds a run ({', '.join(found)}): {where}")
    if not first_rank():  # rank 0 says it and replaces the files
        return
    if resume is not None:
        print(f"The run continues in {output_dir}, a folder of its own: {resume.parent} is left as it was", flush=True)
    elif found and not restart:
        for path in [path for pattern in found for path in output_dir.glob(pattern)]:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        print(
            f"{output_dir} held the start of a run that ended before its first epoch did ({', '.join(found)}): "
            "this run starts there anew",
            flush=True,
        )


def resume_and_output(config: Config, split: DataSplit, data_path: Path, world_size: int):
    """(the checkpoint to resume from, checked against the data, its split and the flags, or None; the output
    folder; the checkpoint's record of its run ("args", with its "world_size" and its "tracked_run"), or None)."""
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
        saved = run_record(resume, state)
        check_same_recipe(resume, saved, config)
        check_same_split(resume, saved.get("split"), split_fingerprint(split, data_path), split.unreadable)
        return resume, output_dir or resume.parent, saved | {"tracked_run": state.get("tracked_run")}
    return None, output_dir or Path("runs") / f"{config.script}-{time.strftime('%Y%m%d-%H%M%S')}", None


def run_record(checkpoint: Path, state: dict) -> dict:
    """The checkpoint's record of its run ("args"), its flags through the command line's checks (run.config's
    admitted: a record edited by hand is refused in one line, as its flags typed would be), with the number of
    processes it was saved by ("world_size") and the one its --batch-size and --lr are given for."""
    source = f"checkpoint {checkpoint}"
    checked = Config.from_record(state["args"], source).record()
    saved = {name: checked.get(name, value) for name, value in state["args"].items()}
    counts = {"world_size": state["world_size"], "recipe_world_size": saved.get("recipe_world_size")}
    counts["recipe_world_size"] = counts["recipe_world_size"] or counts["world_size"]  # older runs: the same
    return saved | {name: admitted({"world_size": n}, f"{source} ({name})")["world_size"] for name, n in counts.items()}


def per_process_recipe(config: Config, saved: dict | None, world_size: int, checkpoint: Path | None):
    """(the configuration to train with on `world_size` processes, the run's batch and rate as given: `given`).

    A run's --batch-size and --lr are given for the number of processes it started on (`recipe_world_size`); a
    step averages batch x processes x --accumulate images at lr x processes x --accumulate (the linear scaling
    rule). Resumed on another number of processes, each process takes a share of the same global batch, and
    --lr scales with it, so that every step averages the same images at the same rate: the recipe, and with
    SyncBatchNorm the very computation, is unchanged (test_equivalence.py's
    test_a_run_resumed_on_another_number_of_processes_takes_the_steps_of_the_uninterrupted_run). A global batch
    that does not split evenly is refused.
    """
    recipe_world_size = world_size if saved is None else saved.get("recipe_world_size", saved["world_size"])
    given = {"batch_size": config.batch_size, "lr": config.lr, "recipe_world_size": recipe_world_size}
    if recipe_world_size == world_size:
        return config, given
    images = config.batch_size * recipe_world_size  # of a micro-batch over all the processes
    if images % world_size:
        raise UserError(
            f"{checkpoint} was trained by {recipe_world_size} process(es) of --batch-size {config.batch_size}: "
            f"its {images} images a step cannot be shared evenly by {world_size} processes; resume on a number of "
            f"processes that divides {images}"
        )
    batch, lr = images // world_size, config.lr * recipe_world_size / world_size
    if first_rank():  # under torchrun every rank prepares: say it once
        print(
            f"Resuming on {world_size} process(es) a run of {recipe_world_size}: {batch} images and --lr {lr:g} "
            f"per process (the run's --batch-size {config.batch_size}, --lr {config.lr:g}), the same "
            f"{images * config.accumulate} images and rate a step"
        )
    return replace(config, batch_size=batch, lr=lr), given


def inexact_resume_note(config: Config, saved: dict | None, world_size: int, choice) -> str | None:
    """The note a resume that keeps the recipe but not the uninterrupted run's exact steps prints (None: it takes
    them, or it is a new run): when a forward pass now takes other images than before (another number of processes,
    another micro-batch) and the model has layers that compute per pass (dropout's masks, BatchNorm's statistics,
    of the passes at one position on every process with --sync-bn). `config` is the per-process recipe
    (per_process_recipe's), `saved` the checkpoint's record."""
    if saved is None:
        return None
    saved_world = saved["world_size"]
    saved_batch = saved["batch_size"] * saved["recipe_world_size"] // saved_world  # per process, as it trained
    before = (saved.get("micro_batch") or saved_batch, saved_world)
    now = (choice.micro_batch or config.batch_size, world_size)
    normalised = lambda images, processes: images * (processes if config.sync_bn else 1)  # noqa: E731
    layers = random_draws(config.model) if before != now else ()
    if normalised(*before) != normalised(*now):
        layers += batch_statistics(config.model)
    if not layers:
        return None
    return (
        f"note: {config.model}'s {' and '.join(layers)} layers compute per forward pass, which now takes {now[0]} "
        f"images on each of {now[1]} process(es), {before[0]} on each of {before[1]} before: this run keeps the "
        "recipe, not the uninterrupted run's exact weights (docs/resuming-and-failures.md)"
    )


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
    if not changed:
        return
    args_file = checkpoint.parent / "args.json"
    own_flags = "the run's own flags" + (f" (--config {args_file} gives them)" if args_file.is_file() else "")
    theirs = saved.get("model", config.model)
    if theirs != config.model:  # its weights, and best.pth, fit no other network: no new run starts from them
        others = [change for change in changed if not change.startswith("--model ")]
        raise UserError(
            f"{checkpoint} is a checkpoint of {theirs}, not of {config.model} (--model)"
            + (f", and was trained with {', '.join(others)}" if others else "")
            + f": resume it with {own_flags}, or start a new {config.model} run without its weights ({theirs}'s "
            f"do not fit {config.model})"
        )
    raise UserError(
        f"{checkpoint} was trained with {', '.join(changed)}: resume with {own_flags}, or start a new run from its "
        f"weights (--weights {checkpoint.parent / 'weights' / 'best.pth'})"
    )


def check_same_split(checkpoint: Path, saved: dict | None, now: dict, unreadable: list[str] = ()) -> None:
    """UserError saying which images differ from those of the checkpoint's run (`saved`, split_fingerprint's
    record): a resumed run must train and validate on the same images, or validation images could become
    training ones half way. Where images of the data folder cannot be read now (`unreadable`, left out of the
    split), they are named as the cause: the files are there, damaged. A checkpoint of a run that recorded none
    (older runs) is accepted."""
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
    if changed and unreadable:
        raise UserError(
            f"{checkpoint} was trained on other images than the data folder's readable ones now, and "
            f"{len(unreadable)} of its files cannot be read ({describe(unreadable)}): if the run read them, they "
            "were damaged since; put back readable copies and resume"
        )
    if changed:
        best = checkpoint.parent / "weights" / "best.pth"
        raise UserError(
            f"{checkpoint} was trained on another split of the data: {'; '.join(changed)}; resume with the run's "
            f"data, or start a new run from its weights (--weights {best})"
        )
