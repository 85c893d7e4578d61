"""A run's configuration: the training scripts' flags as one frozen value, `Config`.

Each field is one flag, declared once with its default, its help and whether it belongs to the recipe (what the
run computes: a resumed run must keep those) or only to how and where it runs (speed, devices, folders: those may
change). The command line is built from these declarations (`parse_config`), a run's args.json loads back into the
same value (`Config.from_record`), and `--config RUN/args.json` starts a new run with that run's recipe.
"""

import argparse
import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from model import DEFAULT_MODEL, IMAGENET, model_names
from my_dataset import AUTO_AUGMENT
from plumbing.compute import CHANNELS_LAST_MIN_SIZE
from plumbing.demo_data import DEMO_DATA_PATH
from utils import HelpFormatter, Parser, UserError, number, positive_float, positive_int

SINGLE, LAUNCH, SPAWN = "train_single_gpu", "train_multi_gpu_using_launch", "train_multi_gpu_using_spawn"
SCRIPTS, DDP_SCRIPTS = (SINGLE, LAUNCH, SPAWN), (LAUNCH, SPAWN)
# --demo trains on generated data with settings that finish in a few minutes on a laptop CPU; any flag given on
# the command line still wins.
DEMO_DEFAULTS = {"epochs": 8, "img_size": 48, "batch_size": 32, "lr": 0.01}
# Weight decay by optimizer: SGD's is an L2 penalty added to the gradient, AdamW's is decoupled (applied to the
# weights directly, as a share of the learning rate), and their usual values differ by that much.
WEIGHT_DECAY = {"sgd": 1e-4, "adamw": 0.05}


def flag(default, group: str, help: str, *, recipe=False, scripts=SCRIPTS, switch=False, **argparse_options):
    """A Config field that is also a command-line flag (--name-with-dashes) of `scripts`, in help group `group`.

    `switch`: an on/off flag with a --no- form (argparse's type=bool would take "False" as true). `recipe`: the
    value decides what the run computes, so a resumed run must keep it.
    """
    if switch:
        argparse_options["action"] = argparse.BooleanOptionalAction
    metadata = {"group": group, "help": help, "recipe": recipe, "scripts": scripts, "argparse": argparse_options}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Config:
    """Everything the command line says about a run (see --help for each flag)."""

    # data
    data_path: Path | None = flag(
        None, "data", "folder with one sub-folder of images per class (e.g. flower_photos)", type=Path
    )
    demo: bool = flag(
        False,
        "data",
        f"train on generated demo flowers (made once in {DEMO_DATA_PATH.parent.name}/) with quick settings",
        action="store_true",
    )
    num_classes: int | None = flag(
        None, "data", "expected number of classes (default: the number of class folders)", type=positive_int
    )
    val_rate: float = flag(
        0.2,
        "data",
        "fraction of each class held out for validation",
        recipe=True,
        type=number(float, 0, 1, above_minimum=True),
    )
    img_size: int = flag(
        224,
        "data",
        "training crop size; validation resizes to img-size*256/224 and centre-crops",
        recipe=True,
        type=positive_int,
    )
    auto_augment: str = flag(
        "none",
        "data",
        "a random photometric or geometric change per training image after the crop and flip "
        "(TrivialAugmentWide or RandAugment from torchvision)",
        recipe=True,
        choices=["none", *AUTO_AUGMENT],
    )
    random_erase: float = flag(
        0.0,
        "data",
        "probability of erasing a random rectangle of each training image (RandomErasing)",
        recipe=True,
        type=number(float, 0, 1),
    )
    class_weights: str = flag(
        "none",
        "data",
        "balanced: weigh each class's loss by the inverse of its share of the training images",
        recipe=True,
        choices=["none", "balanced"],
    )
    workers: int | None = flag(
        None,
        "data",
        "data loader processes per training process (default: on a GPU, this process's share of the cores, "
        "at most 8; on the CPU, one per 8 cores of its share, the rest training)",
        type=number(int, 0),
    )

    # optimisation
    epochs: int = flag(30, "optimisation", "passes over the training images", recipe=True, type=positive_int)
    batch_size: int = flag(16, "optimisation", "images per step in each process", recipe=True, type=positive_int)
    lr: float = flag(
        0.001,
        "optimisation",
        "learning rate for one process; multiplied by the world size in DDP",
        recipe=True,
        type=positive_float,
    )
    lrf: float = flag(
        0.1,
        "optimisation",
        "final learning rate as a fraction of --lr (cosine decay)",
        recipe=True,
        type=number(float, 0, 1, above_minimum=True),
    )
    opt: str = flag(
        "sgd",
        "optimisation",
        "optimizer: SGD with momentum, or AdamW (decoupled weight decay)",
        recipe=True,
        choices=["sgd", "adamw"],
    )
    momentum: float = flag(0.9, "optimisation", "SGD momentum", recipe=True, type=number(float, 0, 1))
    weight_decay: float | None = flag(
        None,
        "optimisation",
        f"weight decay (default: {WEIGHT_DECAY['sgd']:g} with SGD, usual for ResNets (the original used 5e-3); "
        f"{WEIGHT_DECAY['adamw']:g} with AdamW)",
        recipe=True,
        type=number(float, 0),
    )
    warmup_epochs: int = flag(
        0,
        "optimisation",
        "epochs over which the learning rate rises linearly, step by step, before the cosine decay",
        recipe=True,
        type=number(int, 0),
    )
    accumulate: int = flag(
        1,
        "optimisation",
        "micro-batches of --batch-size whose gradients are summed before each step (a step then sees "
        "batch-size x accumulate x world-size images, and the learning rate is scaled by that many batches)",
        recipe=True,
        type=positive_int,
    )
    label_smoothing: float = flag(
        0.0,
        "optimisation",
        "share of each target spread evenly over all classes",
        recipe=True,
        type=number(float, 0, 1),
    )
    mixup_alpha: float = flag(
        0.0,
        "optimisation",
        "mix pairs of training images and their targets by a Beta(alpha, alpha) share (0: off)",
        recipe=True,
        type=number(float, 0),
    )
    cutmix_alpha: float = flag(
        0.0,
        "optimisation",
        "paste a box of one training image into another, targets by area (0: off; with mixup, each step "
        "takes one of the two at random)",
        recipe=True,
        type=number(float, 0),
    )
    seed: int = flag(
        0,
        "optimisation",
        "seeds weights, data split, shuffling and augmentation",
        recipe=True,
        type=number(int, 0),
    )

    # model
    model: str = flag(
        DEFAULT_MODEL,
        "model",
        "any torchvision classification model: resnet18, resnet50, mobilenet_v3_small, efficientnet_b0, "
        "convnext_tiny, ...",
        recipe=True,
        choices=model_names(),
        metavar="NAME",
    )
    weights: str | Path | None = flag(
        None,
        "model",
        f"initial weights: {IMAGENET} (torchvision's ImageNet-1K weights for --model, downloaded once into "
        "torch's cache), a torchvision file for that model, or weights or a checkpoint saved by these scripts",
        type=lambda text: text if text == IMAGENET else Path(text),
    )
    freeze_layers: bool = flag(False, "model", "train only the classifier head", recipe=True, switch=True)
    model_ema: bool = flag(
        False,
        "model",
        "keep an exponential moving average of the weights (BatchNorm statistics included), validated and "
        "saved beside the model; best.pth is the better of the two",
        recipe=True,
        switch=True,
    )
    ema_decay: float = flag(
        0.999,
        "model",
        "share of the average kept at each step (0.999: about the last 1,000 steps)",
        recipe=True,
        type=number(float, 0, 1, above_minimum=True),
    )
    data_parallel: bool = flag(
        False,
        "model",
        "split each batch over all visible GPUs with nn.DataParallel in this one process "
        "(DDP, the other two scripts, is faster: see docs/launch-modes.md)",
        scripts=(SINGLE,),
        action="store_true",
    )

    # speed
    amp: str = flag(
        "auto",
        "speed",
        "mixed precision (torch.amp autocast): auto is bf16 where the device computes it natively "
        "(GPUs from Ampere on, CPUs with AMX or AVX512-BF16 that torch is not capped below) and off (float32) "
        "elsewhere; fp16 adds gradient scaling",
        choices=["auto", "off", "bf16", "fp16"],
    )
    channels_last: bool | None = flag(
        None,
        "speed",
        "keep images and weights in NHWC memory layout (default: on GPUs, and on the CPU for images of "
        f"{CHANNELS_LAST_MIN_SIZE} px and up, where it is faster)",
        switch=True,
    )
    compile: bool = flag(
        False,
        "speed",
        "torch.compile the model: faster steps after a compilation of a minute or more at the start",
        action="store_true",
    )
    persistent_workers: bool = flag(
        True,
        "speed",
        "keep loader processes between epochs (off restarts them every epoch, as the original scripts did)",
        switch=True,
    )

    # run
    resume: Path | None = flag(None, "run", "continue the run whose checkpoint.pth this is (in its folder)", type=Path)
    auto_resume: bool = flag(
        False,
        "run",
        "continue from --output-dir's checkpoint.pth when there is one, else start (for torchrun restarts)",
        action="store_true",
    )
    save_every: int = flag(
        0,
        "run",
        "also keep weights/model-N.pth of every N-th epoch (0: keep only best.pth, last.pth and the checkpoint)",
        type=number(int, 0),
    )
    strict_images: bool = flag(
        False, "run", "stop on unreadable images instead of skipping them with a warning", action="store_true"
    )
    device: str | None = flag(None, "run", "cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    output_dir: Path | None = flag(
        None, "run", "where weights, logs and metrics go (default: runs/<script>-<timestamp>)", type=Path
    )

    # distributed
    sync_bn: bool = flag(
        True,
        "distributed",
        "synchronise BatchNorm statistics across processes",
        recipe=True,
        scripts=DDP_SCRIPTS,
        switch=True,
    )
    dist_url: str = flag(
        "env://",
        "distributed",
        "how processes find each other (env:// reads MASTER_ADDR and MASTER_PORT)",
        scripts=DDP_SCRIPTS,
    )
    dist_backend: str | None = flag(
        None,
        "distributed",
        "communication library (default: nccl on CUDA, gloo on CPU)",
        scripts=DDP_SCRIPTS,
        choices=["nccl", "gloo"],
    )
    dist_timeout: int = flag(
        1800,
        "distributed",
        "seconds a collective may wait for a silent process",
        scripts=DDP_SCRIPTS,
        type=positive_int,
    )
    world_size: int | None = flag(
        None,
        "distributed",
        "processes to start (default: visible GPUs, or 2 without a GPU)",
        scripts=(SPAWN,),
        type=positive_int,
    )

    script: str = SINGLE  # which script's flags these are (not a flag)

    @classmethod
    def recipe_fields(cls) -> tuple[str, ...]:
        """The fields that decide what a run computes (a resumed run must keep them)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("recipe"))

    @classmethod
    def default(cls, name: str):
        return cls.__dataclass_fields__[name].default

    @classmethod
    def from_record(cls, record: dict) -> "Config":
        """A run's saved configuration (args.json, or a checkpoint's "args") as a Config: unknown keys are
        ignored, missing ones take their defaults, paths become Paths again."""
        known = {f.name: f for f in fields(cls)}
        values = {}
        for name, value in record.items():
            if name in known:
                path_field = known[name].metadata.get("argparse", {}).get("type") is Path
                values[name] = Path(value) if path_field and value is not None else value
        return cls(**values)

    def record(self, **decided) -> dict:
        """JSON-able plain data (paths as strings), with what was decided from the flags (`decided`, e.g. the data
        folder --demo chose, the memory layout "auto" chose): args.json, and the checkpoint's "args"."""
        plain = lambda value: str(value) if isinstance(value, Path) else value  # noqa: E731
        return {key: plain(value) for key, value in {**asdict(self), **decided}.items()}


def build_parser(script: str, description: str) -> argparse.ArgumentParser:
    """The command line of `script`: every Config field that is one of its flags, in its help group."""
    parser = Parser(description=description, formatter_class=HelpFormatter)
    groups = {}
    for f in fields(Config):
        if f.default is MISSING or script not in f.metadata.get("scripts", ()):
            continue
        group = groups.get(f.metadata["group"]) or groups.setdefault(
            f.metadata["group"], parser.add_argument_group(f.metadata["group"])
        )
        group.add_argument(
            "--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **f.metadata["argparse"]
        )
    parser.add_argument(
        "--config",
        type=Path,
        help="start with the recipe and data of a run's args.json (RUN/args.json); flags given here still win",
    )
    return parser


def parse_config(script: str, description: str, argv=None) -> Config:
    """The command line as a Config: --config's run first, then --demo's quick settings, then the flags given."""
    parser = build_parser(script, description)
    given = parser.parse_args(argv)
    defaults = {}
    if given.demo:
        defaults |= DEMO_DEFAULTS
    if given.config is not None:
        defaults |= recipe_of(given.config)
    if defaults:
        parser.set_defaults(**defaults)
        given = parser.parse_args(argv)
    values = {name: value for name, value in vars(given).items() if name != "config"}
    config = Config(**values, script=script)
    if config.weight_decay is None:
        config = replace(config, weight_decay=WEIGHT_DECAY[config.opt])
    if config.warmup_epochs >= config.epochs:
        parser.error(f"--warmup-epochs {config.warmup_epochs} leaves no epoch of --epochs {config.epochs} to decay")
    return config


def recipe_of(path: Path) -> dict:
    """The recipe fields and the data of the run whose args.json `path` is, as parser defaults."""
    try:
        record = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read --config {path}: {error.strerror}") from None
    except ValueError as error:
        raise UserError(f"--config {path} is not a run's args.json ({error})") from None
    if not isinstance(record, dict):
        raise UserError(f"--config {path} is not a run's args.json (a JSON object of flags)")
    saved = Config.from_record(record)
    return {name: getattr(saved, name) for name in (*Config.recipe_fields(), "data_path", "demo") if name in record}
