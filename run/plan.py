"""The checked plan: what a run decides from its configuration before any training process starts (`prepare`),
so that every mistake in the input ends here, in one line (docs/resuming-and-failures.md); and the run's first
lines, the plan with auto's choice (`announce`)."""

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dataset.demo import DEMO_DATA_PATH, make_demo_data
from dataset.folders import DataSplit, read_split_data, split_fingerprint
from dataset.image_check import ImageCheck
from dataset.store import StoredImages, store_folder
from dataset.transforms import decode_sides
from model import check_input_size
from multi_train_utils.checkpoint import CHECKPOINT_NAME, load_checkpoint
from multi_train_utils.distributed_utils import (
    check_backend,
    launcher_environment,
    print_once,
    resolve_device,
    warn_once,
)
from network.architectures import batch_statistics, create_model, random_draws
from network.weights import load_weights, read_state_dict, weights_file
from recipe.loss import describe_class_weights
from recipe.optimizer import describe_learning_rate
from run.config import Config, admitted
from run.folder_lock import hold_run_folder
from run.metrics import METRICS_NAME, read_metrics
from run.records import of_their_model
from run.tracking import reachable_tracker
from utils import UserError, check_writable, describe, printable, run_files_in, warn, writing


@dataclass(frozen=True)
class Plan:
    """What prepare decided: the data and its split, the weights, the checkpoint to resume and the output folder."""

    data_path: Path
    split: DataSplit
    output_dir: Path
    weights: Path | None = None
    resume: Path | None = None
    given: dict = field(default_factory=dict)  # the run's --batch-size and --lr, for `recipe_world_size` processes
    saved: dict | None = None  # the resumed checkpoint's record of its run (run_record), None for a new run
    store: Path | None = None  # the image store of the split's images (dataset/store.py), None: read from files
    images_line: str = ""  # what became of the images: in a store, or read from their files every epoch
    recipe_lines: tuple = ()  # what the run's start says of its learning rate, class weights and compilation

    @property
    def tracked_run(self) -> dict | None:
        """The resumed checkpoint's "tracked_run" (run/tracking.py), if it has one."""
        return self.saved.get("tracked_run") if self.saved else None


def prepare(config: Config, world_size: int) -> tuple[Config, Plan]:
    """Check the input and make the decisions that need no process group, for `world_size` processes: the config
    to train with (per_process_recipe's) and the Plan. Holds the output folder for the process that writes there;
    UserError for bad input or a folder another live run holds."""
    # What the run needs beyond Python, before anything is loaded: where it lacks it, the fallback said in one line
    asked_to_compile = config.compile
    config = compiled_if_it_can(config)
    config = reachable_tracker(config) if first_rank() else config  # rank 0 tracks
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
    stored = StoredImages(store_folder(config.store_dir), decode_sides(config.img_size), config.store_side, check)
    split = read_split_data(data_path, config.val_rate, config.seed, verify_images=stored)
    resume, output_dir, saved = resume_and_output(config, split, Path(data_path), world_size)
    config, given = per_process_recipe(config, saved, world_size, resume)
    check_split(config, split, data_path, world_size)
    weights = None
    if config.weights is not None:
        weights = weights_file(config.weights, config.model)  # `imagenet`: downloaded here, before any worker starts
        state_dict, model = read_state_dict(weights), create_model(len(split.classes), config.model)
        fix = "train {theirs} from them (--model {theirs}), or {model} from other weights (--weights imagenet, or none)"
        with of_their_model(weights, config.model, fix):  # (read first: a file that cannot be read is said as such)
            report = load_weights(model, state_dict, name=config.model, what=f"weights file {weights}")
        if first_rank():  # under torchrun every rank prepares: say it once
            print(f"Weights from {weights}: {report.summary()}", flush=True)
    check_writable(output_dir)
    if first_rank():  # under torchrun every rank prepares; rank 0 writes
        hold_run_folder(output_dir)  # before looking at what the folder holds: another live run may be writing it
    claim_run_folder(output_dir, resume, restart=config.auto_resume)
    if resume is not None:
        read_metrics(output_dir / METRICS_NAME)  # a damaged record of the epochs refuses the resume before any write
    if first_rank() and stored.path is None:
        check.save(output_dir)  # the images' verdicts, for the next start of this run (a restart, a resume)
    lines = recipe_lines(config, split, world_size, uncompiled=asked_to_compile and not config.compile)
    return config, Plan(Path(data_path), split, output_dir, weights, resume, given, saved, stored.path, stored.line,
                        lines)  # fmt: skip


def announce(config, plan, process, choice) -> None:
    """The run's first lines: its processes, data, auto's choice, a resume's note, and the plan's recipe lines."""
    split = plan.split
    backend = f", backend {torch.distributed.get_backend()}" if process.distributed else ""
    lines = [f"{config.script}: {process.world_size} process(es) on {process.device.type}{backend}"]
    if process.device.type == "cpu" and not torch.cuda.is_available():
        lines.append("No CUDA GPU found: training on the CPU.")
    lines.append(f"Data: {len(split.train_images)} training / {len(split.val_images)} validation images, "
                 f"{len(split.classes)} classes{' (train/, val/ as given)' * split.given}; "
                 f"{choice.workers} loader workers per process")  # fmt: skip
    lines += [plan.images_line, *choice.lines, inexact_resume_note(config, plan.saved, process.world_size, choice)]
    lines += plan.recipe_lines
    if split.unreadable:
        warn_once(f"skipped {len(split.unreadable)} unreadable image(s): {describe(split.unreadable)}")
    for line in lines:
        if line is not None:
            print_once(line)


def check_split(config: Config, split: DataSplit, data_path: Path, world_size: int) -> None:
    if split.given and config.val_rate != Config.default("val_rate") and first_rank():
        print(f"note: --val-rate {config.val_rate} is ignored: {data_path} holds train/ and val/, used as given")
    if split.unreadable and config.strict_images:
        raise UserError(f"{len(split.unreadable)} unreadable image(s) (--strict-images): {describe(split.unreadable)}")
    if len(split.classes) < 2:  # one class: its loss is 0 from the first step, and nothing is learnt
        raise UserError(f"{data_path} has one class folder ({split.classes[0]}): a classifier needs at least 2 classes "
                        "to tell apart, each a sub-folder of the data path")  # fmt: skip
    if config.num_classes is not None and config.num_classes != len(split.classes):
        raise UserError(f"--num-classes {config.num_classes} but {data_path} has {len(split.classes)} class folders: "
                        + ", ".join(split.classes))  # fmt: skip
    per_process = len(split.train_images) // world_size
    if per_process < config.batch_size:
        raise UserError(f"--batch-size {config.batch_size} is larger than the {per_process} training images each of "
                        f"{world_size} process(es) gets: an epoch would have no step")  # fmt: skip


def first_rank() -> bool:
    """Whether this process is rank 0, before any process group exists (under torchrun every rank prepares)."""
    return (launcher_environment() or {}).get("rank", 0) == 0


def recipe_lines(config: Config, split: DataSplit, world_size: int, uncompiled: bool) -> tuple:
    """The lines the run's start says of its learning rate, class weights (if any) and compilation."""
    compiling = (  # auto never compiles, as measured (docs/performance.md, "Compiled")
        "Compile: on (--compile): the first steps compile the model, the later ones run compiled"
        if config.compile
        else f"Compile: off (--compile given, but it needs {compile_needs(resolve_device(config.device).type)})"
        if uncompiled
        else "Compile: off (auto never compiles: measured, a compilation of half a minute or more repays itself only "
        "in long GPU runs, never on a CPU; --compile to compile, docs/performance.md says when)"
    )
    lines = (describe_learning_rate(config, world_size), describe_class_weights(config, split), compiling)
    return tuple(line for line in lines if line is not None)


def compiled_if_it_can(config: Config) -> Config:
    """`config`, with --compile off where torch.compile lacks what it needs beyond Python on the run's device, said
    in one warning: found here, before anything is loaded, not at the first step (docs/performance.md, "Compiled")."""
    missing = compile_needs(resolve_device(config.device).type) if config.compile else None
    if missing is None:
        return config
    if first_rank():  # under torchrun every rank prepares: say it once
        warn(f"--compile needs {missing}: the run trains uncompiled (eager)")
    return replace(config, compile=False)


def compile_needs(device_type: str) -> str | None:
    """What torch.compile lacks here to compile for `device_type`, in words, as torch and Triton look it up; None:
    nothing (other devices are left to torch.compile)."""
    if device_type == "cpu":  # inductor's kernels are C++, built by the compiler it looks up
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except RuntimeError as error:  # InvalidCxxCompiler, or MSVC's checks on Windows
            return f"a C++ compiler on the CPU ({error}): install g++, or name one in CXX"
    if device_type == "cuda":  # its kernels are Triton's, whose launchers a C compiler builds
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton on a GPU, which torch does not find here: pip install triton"
        if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):  # as Triton looks one up
            return "a C compiler for Triton on a GPU, and none is found: install gcc, or name one in CC"
    return None


# The files a run writes once an epoch has ended: a folder holding none of them holds nothing to keep
FINISHED_EPOCH_FILES = (METRICS_NAME, CHECKPOINT_NAME, "weights/*.pth")


def claim_run_folder(output_dir: Path, resume: Path | None, restart: bool) -> None:
    """Refuse a run that would write into another run's folder: a resume writes into its own or one holding no run's
    files, a new run into one holding no finished epoch (replacing a start that finished none), a restart (--auto-resume
    without a checkpoint) into one whose start saved none (docs/resuming-and-failures.md, "One run per folder")."""
    if resume is not None and output_dir.resolve() == resume.parent.resolve():
        return
    found = run_files_in(output_dir)
    finished = [name for name in found if name in FINISHED_EPOCH_FILES]
    unsaved = restart and len(read_metrics(output_dir / METRICS_NAME)) <= 1  # at most the epoch that failed to save
    if (finished or found and resume is not None) and not unsaved:
        where = (
            f"resume {resume} in its own folder (leave out --output-dir) or into a new or empty one"
            if resume is not None
            else f"epochs finished but no {CHECKPOINT_NAME} to continue from: choose another --output-dir"
            if restart
            else "continue it with --auto-resume, or choose another --output-dir"
        )
        raise UserError(f"{output_dir} already holds a run ({', '.join(found)}): {where}")
    if not first_rank():  # rank 0 says it and replaces the files
        return
    if resume is not None:
        print(f"The run continues in {output_dir}, a folder of its own: {resume.parent} is left as it was", flush=True)
    if finished and unsaved:
        with writing(output_dir):
            for path in [path for pattern in finished for path in output_dir.glob(pattern)]:
                path.unlink()
        print(f"{output_dir} held a start that saved no checkpoint ({', '.join(finished)}): it starts again",
              flush=True)  # fmt: skip
    elif found and not restart and resume is None:
        with writing(output_dir):
            for path in [path for pattern in found for path in output_dir.glob(pattern)]:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        print(f"{output_dir} held the start of a run that ended before its first epoch did ({', '.join(found)}): "
              "this run starts there anew", flush=True)  # fmt: skip


def resume_and_output(config: Config, split: DataSplit, data_path: Path, world_size: int):
    """(the checkpoint to resume, checked, or None; the output folder; the checkpoint's record of its run, or None)."""
    resume, output_dir = config.resume, config.output_dir
    if config.auto_resume:
        if output_dir is None:
            raise UserError("--auto-resume needs --output-dir: the folder where a restarted job finds its checkpoint")
        if (output_dir / CHECKPOINT_NAME).exists():  # its own, first (a resume into a new folder continues there)
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
    """The checkpoint's "args" through the command line's checks, with its "world_size" and "recipe_world_size"."""
    source = f"checkpoint {checkpoint}"
    checked = Config.from_record(state["args"], source).record()
    saved = {name: checked.get(name, value) for name, value in state["args"].items()}
    counts = {"world_size": state["world_size"], "recipe_world_size": saved.get("recipe_world_size")}
    counts["recipe_world_size"] = counts["recipe_world_size"] or counts["world_size"]  # older runs: the same
    return saved | {name: admitted({"world_size": n}, f"{source} ({name})")["world_size"] for name, n in counts.items()}


def per_process_recipe(config: Config, saved: dict | None, world_size: int, checkpoint: Path | None):
    """(the config to train with on `world_size` processes, the run's batch and rate as given). Resumed on another
    number of processes than its --batch-size and --lr are given for, each process takes a share of the same global
    batch and rate, so every step is the same (docs/guarantees.md); UserError where it does not split evenly."""
    recipe_world_size = world_size if saved is None else saved.get("recipe_world_size", saved["world_size"])
    given = {"batch_size": config.batch_size, "lr": config.lr, "recipe_world_size": recipe_world_size}
    if recipe_world_size == world_size:
        return config, given
    images = config.batch_size * recipe_world_size  # of a micro-batch over all the processes
    if images % world_size:
        raise UserError(f"{checkpoint} was trained by {recipe_world_size} process(es) of --batch-size "
                        f"{config.batch_size}: its {images} images a step cannot be shared evenly by {world_size} "
                        f"processes; resume on a number of processes that divides {images}")  # fmt: skip
    batch, lr = images // world_size, config.lr * recipe_world_size / world_size
    if first_rank():  # under torchrun every rank prepares: say it once
        print(f"Resuming on {world_size} process(es) a run of {recipe_world_size}: {batch} images and --lr {lr:g} "
              f"per process (the run's --batch-size {config.batch_size}, --lr {config.lr:g}), the same "
              f"{images * config.accumulate} images and rate a step")  # fmt: skip
    return replace(config, batch_size=batch, lr=lr), given


def inexact_resume_note(config: Config, saved: dict | None, world_size: int, choice) -> str | None:
    """The note of a resume that keeps the recipe but not the exact steps (None: it keeps them, or a new run): a
    forward pass now takes other images, and the model has layers that compute per pass (dropout, BatchNorm).
    `config` is per_process_recipe's."""
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
    return (f"note: {config.model}'s {' and '.join(layers)} layers compute per forward pass, which now takes {now[0]} "
            f"images on each of {now[1]} process(es), {before[0]} on each of {before[1]} before: this run keeps the "
            "recipe, not the uninterrupted run's exact weights (docs/resuming-and-failures.md)")  # fmt: skip


def check_same_recipe(checkpoint: Path, saved: dict, config: Config) -> None:
    """UserError naming every recipe field that differs from the checkpoint's run's (speed flags may differ)."""
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
    raise UserError(f"{checkpoint} was trained with {', '.join(changed)}: resume with {own_flags}, or start a new "
                    f"run from its weights (--weights {checkpoint.parent / 'weights' / 'best.pth'})")  # fmt: skip


def check_same_split(checkpoint: Path, saved: dict | None, now: dict, unreadable: list[str] = ()) -> None:
    """UserError saying which images differ from the checkpoint's run's (`saved`, split_fingerprint's; None: older
    run, accepted), naming images unreadable now as the cause where there are any."""
    if saved is None:
        return
    changed = []
    for subset, name in (("train", "training"), ("val", "validation")):
        then_count, now_count = saved[f"{subset}_images"], now[f"{subset}_images"]
        if saved[f"{subset}_sha256"] != now[f"{subset}_sha256"]:
            had = f" where the run had {then_count}" if now_count != then_count else ", not all the run's"
            changed.append(f"{now_count} {name} images{had}")
    if changed and unreadable:
        raise UserError(f"{checkpoint} was trained on other images than the data folder's readable ones now, and "
                        f"{len(unreadable)} of its files cannot be read ({describe(unreadable)}): if the run read "
                        "them, they were damaged since; put back readable copies and resume")  # fmt: skip
    if changed:
        best = checkpoint.parent / "weights" / "best.pth"
        raise UserError(f"{checkpoint} was trained on another split of the data: {'; '.join(changed)}; resume with "
                        f"the run's data, or start a new run from its weights (--weights {best})")  # fmt: skip
