"""A run's configuration, `Config`: each of the training scripts' flags declared once, with its default, its help and
whether it is recipe; the command line, args.json (`Config.from_record`) and --config all go through them."""

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cache, partial
from pathlib import Path

from dataset.demo import DEMO_DATA_PATH
from dataset.transforms import AUTO_AUGMENT
from model import check_model_options
from network.architectures import DEFAULT_MODEL, IMAGENET, TIMM, unknown_model
from utils import HelpFormatter, Parser, UserError, number, positive_float, positive_int

SINGLE, LAUNCH, SPAWN = "train_single_gpu", "train_multi_gpu_using_launch", "train_multi_gpu_using_spawn"
SCRIPTS, DDP_SCRIPTS = (SINGLE, LAUNCH, SPAWN), (LAUNCH, SPAWN)
# --demo's settings, which finish in a few minutes on a laptop CPU (any flag given still wins)
DEMO_DEFAULTS = {"epochs": 8, "img_size": 48, "batch_size": 32, "lr": 0.01}
# Weight decay by optimizer: SGD's is an L2 penalty on the gradient, AdamW's decoupled, hence their different scales
WEIGHT_DECAY = {"sgd": 1e-4, "adamw": 0.05}


def flag(default, help: str, *, group: str, recipe=False, scripts=SCRIPTS, switch=False, **argparse_options):
    """A Config field that is a flag of `scripts` in help group `group` (`recipe`: a resume must keep it)."""
    if switch:
        argparse_options["action"] = argparse.BooleanOptionalAction
    metadata = {"group": group, "help": help, "recipe": recipe, "scripts": scripts, "argparse": argparse_options}
    return field(default=default, metadata=metadata)


def auto_or(kind):
    """A flag's type for `kind` values or the word auto, which leaves the value to be measured (None)."""

    def value(text: str):
        return None if text == "auto" else kind(text)

    value.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its refusals
    return value


def model_name(text: str) -> str:
    """--model's type: a torchvision classification model's name, or timm/ and one of timm's."""
    if reason := unknown_model(text):
        raise argparse.ArgumentTypeError(reason)
    return text


data_flag, data_recipe = partial(flag, group="data"), partial(flag, group="data", recipe=True)
optimisation_recipe = partial(flag, group="optimisation", recipe=True)
model_flag, model_recipe = partial(flag, group="model"), partial(flag, group="model", recipe=True)
single_process_flag = partial(flag, group="model", scripts=(SINGLE,))
speed_flag, run_flag = partial(flag, group="speed"), partial(flag, group="run")
ddp_flag = partial(flag, group="distributed", scripts=DDP_SCRIPTS)
ddp_recipe = partial(flag, group="distributed", recipe=True, scripts=DDP_SCRIPTS)
spawn_flag = partial(flag, group="distributed", scripts=(SPAWN,))


@dataclass(frozen=True)
class Config:
    """Everything the command line says about a run (see --help for each flag)."""

    # fmt: off
    data_path: Path | None = data_flag(None, "folder with one sub-folder of images per class", type=Path)
    demo: bool = data_flag(False, f"train on generated demo flowers ({DEMO_DATA_PATH.parent.name}/) with quick "
                           "settings", action="store_true")
    num_classes: int | None = data_flag(None, "expected number of classes (default: the class folders')",
                                        type=positive_int)
    val_rate: float = data_recipe(0.2, "fraction of each class held out for validation",
                                  type=number(float, 0, 1, above_minimum=True))
    img_size: int = data_recipe(224, "training crop size; validation resizes to img-size*256/224 and centre-crops",
                                type=positive_int)
    auto_augment: str = data_recipe("none", "a random change per training image after the crop and flip",
                                    choices=["none", *AUTO_AUGMENT])
    random_erase: float = data_recipe(0.0, "probability of erasing a random rectangle of each training image",
                                      type=number(float, 0, 1))
    class_weights: str = data_recipe("none", "balanced: weigh each class's loss by the inverse of its share of the "
                                     "images", choices=["none", "balanced"])
    workers: int | None = data_flag(None, "loader processes per training process (default: auto, from a measured "
                                    "image's load against a step's)", type=number(int, 0))

    epochs: int = optimisation_recipe(30, "passes over the training images", type=positive_int)
    batch_size: int = optimisation_recipe(16, "images per step in each process", type=positive_int)
    lr: float = optimisation_recipe(0.001, "learning rate for one process; multiplied by the world size in DDP",
                                    type=positive_float)
    lrf: float = optimisation_recipe(0.1, "final learning rate as a fraction of --lr (cosine decay)",
                                     type=number(float, 0, 1, above_minimum=True))
    opt: str = optimisation_recipe("sgd", "SGD with momentum, or AdamW", choices=["sgd", "adamw"])
    momentum: float = optimisation_recipe(0.9, "SGD momentum", type=number(float, 0, 1))
    weight_decay: float | None = optimisation_recipe(None, f"default: {WEIGHT_DECAY['sgd']:g} with SGD (the original "
                                                     f"used 5e-3), {WEIGHT_DECAY['adamw']:g} with AdamW",
                                                     type=number(float, 0))
    norm_weight_decay: float | None = optimisation_recipe(None, "weight decay of norm layers' weights and biases "
                                                          "(timm: its own choice); 0 is usual for fine-tuning",
                                                          type=number(float, 0), metavar="X")
    layer_decay: float = optimisation_recipe(1.0, "layer-wise rate decay: the head at the full rate, each layer "
                                             "before it F times the next one's (1: off)",
                                             type=number(float, 0, 1, above_minimum=True), metavar="F")
    clip_grad_norm: float = optimisation_recipe(0.0, "clip each step's gradients to this total 2-norm (0: off)",
                                                type=number(float, 0), metavar="MAX")
    warmup_epochs: int = optimisation_recipe(0, "epochs of a linear rise of the learning rate before the cosine decay",
                                             type=number(int, 0))
    accumulate: int = optimisation_recipe(1, "batches whose gradients each step sums (the rate scaled by as many)",
                                          type=positive_int)
    label_smoothing: float = optimisation_recipe(0.0, "share of each target spread evenly over all classes",
                                                 type=number(float, 0, 1))
    mixup_alpha: float = optimisation_recipe(0.0, "mix pairs of images and targets by a Beta(alpha, alpha) share "
                                             "(0: off)", type=number(float, 0))
    cutmix_alpha: float = optimisation_recipe(0.0, "paste a box of one image into another, targets by area (0: off)",
                                              type=number(float, 0))
    seed: int = optimisation_recipe(0, "seeds weights, data split, shuffling and augmentation", type=number(int, 0))

    model: str = model_recipe(DEFAULT_MODEL, "any torchvision classification model (resnet50, efficientnet_b0, ...) "
                              f"or {TIMM}NAME, any of timm's", type=model_name, metavar="NAME")
    weights: str | Path | None = model_flag(None, f"initial weights: {IMAGENET} (--model's pretrained ones), a .pth "
                                            "or .safetensors file, or a run's weights",
                                            type=lambda text: text if text == IMAGENET else Path(text))
    freeze_layers: bool = model_recipe(False, "train only the classifier head", switch=True)
    model_ema: bool = model_recipe(False, "keep, validate and save a moving average of the weights (best.pth: the "
                                   "better)", switch=True)
    ema_decay: float = model_recipe(0.999, "share of the average kept at each step",
                                    type=number(float, 0, 1, above_minimum=True))
    data_parallel: bool = single_process_flag(False, "split each batch over every visible GPU with nn.DataParallel "
                                              "(DDP is faster)", action="store_true")

    amp: str = speed_flag("auto", "autocast precision: auto times float32 and, where the device computes it, bf16 "
                          "(fp16 scales gradients)", choices=["auto", "off", "bf16", "fp16"])
    channels_last: bool | None = speed_flag(None, "NHWC memory layout (default: auto, whichever trains faster here)",
                                            switch=True)
    remeasure: bool = speed_flag(False, "measure what auto chooses again instead of taking an earlier run's choice",
                                 action="store_true")
    micro_batch: int | None = speed_flag(None, "most images a forward and backward pass takes; the step is the same "
                                         "(default: auto, on a GPU what fits)", type=auto_or(positive_int), metavar="N")
    compile: bool = speed_flag(False, "torch.compile the model (a compilation of a minute or more)",
                               action="store_true")
    grad_checkpointing: bool = speed_flag(False, "recompute each block's activations in the backward pass: less memory",
                                          action="store_true")
    store_dir: str | None = speed_flag(None, "the image store's folder: the images decoded once for every run "
                                       "(default: the user's cache; off: none, each image decoded from its file "
                                       "every epoch)", metavar="DIR")
    store_side: int | None = speed_flag(None, "the shorter side the store keeps an image at, at most (default: auto, "
                                        "as decoded unless the disk holds only less)", type=auto_or(positive_int),
                                        metavar="N")
    device_images_gb: float | None = speed_flag(None, "GB of the device's memory the training images may be held in "
                                                "(default: half its free memory); where they take more, each batch is "
                                                "streamed to it from the store", type=number(float, 0))
    persistent_workers: bool = speed_flag(True, "keep loader processes between epochs (off: restarted every epoch, as "
                                          "the original)", switch=True)
    batches: str = speed_flag("auto", "where training batches are made: on the device from images held there, or by "
                              "the loader (auto: measured)", choices=["auto", "device", "loader"])

    resume: Path | None = run_flag(None, "continue the run whose checkpoint.pth this is (in its folder)", type=Path)
    auto_resume: bool = run_flag(False, "continue from --output-dir's checkpoint.pth when there is one, else start",
                                 action="store_true")
    save_every: int = run_flag(0, "also keep weights/model-N.pth of every N-th epoch (0: none)", type=number(int, 0))
    strict_images: bool = run_flag(False, "stop on unreadable images instead of skipping them", action="store_true")
    device: str | None = run_flag(None, "cpu, cuda, cuda:N or mps (default: cuda if a GPU is visible, else mps, else "
                                  "cpu)")
    output_dir: Path | None = run_flag(None, "where the run's files go (default: runs/<script>-<timestamp>)", type=Path)
    tracking_uri: str | None = run_flag(None, "log the run to MLflow at URI (default: MLFLOW_TRACKING_URI; see "
                                        "docs/tracking.md)", metavar="URI")
    track_weights: bool = run_flag(False, "with tracking, also upload weights/best.pth at the end", action="store_true")

    sync_bn: bool = ddp_recipe(True, "synchronise BatchNorm statistics across processes", switch=True)
    dist_url: str = ddp_flag("env://", "how processes find each other (env:// reads MASTER_ADDR and MASTER_PORT)")
    dist_backend: str | None = ddp_flag(None, "communication library (default: nccl on CUDA where torch has it, else "
                                        "gloo)", choices=["nccl", "gloo"])
    dist_timeout: int = ddp_flag(1800, "seconds a collective may wait for a silent process", type=positive_int)
    world_size: int | None = spawn_flag(None, "processes to start (default: the visible GPUs, or 2)", type=positive_int)
    # fmt: on

    script: str = SINGLE  # which script's flags these are (not a flag)

    @classmethod
    def recipe_fields(cls) -> tuple[str, ...]:
        """The fields that decide what a run computes (a resumed run must keep them)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("recipe"))

    @classmethod
    def default(cls, name: str):
        return cls.__dataclass_fields__[name].default

    @classmethod
    def from_record(cls, record: dict, source: str) -> "Config":
        """A run's record through the command line's checks (`admitted`); unknown keys ignored, missing ones default."""
        known = {f.name for f in fields(cls)} - {"script"}
        script = record.get("script") if record.get("script") in SCRIPTS else SINGLE
        return cls(**admitted({name: value for name, value in record.items() if name in known}, source), script=script)

    def record(self, **decided) -> dict:
        """args.json's and the checkpoint's "args": JSON-able (paths as strings), with what was `decided` from them."""
        plain = lambda value: str(value) if isinstance(value, Path) else value  # noqa: E731
        return {key: plain(value) for key, value in {**asdict(self), **decided}.items()}


def add_flags(parser: argparse.ArgumentParser, script: str | None) -> argparse.ArgumentParser:
    """Every Config field that is a flag of `script` (of any script: None) added to `parser`, in its help group."""
    groups = {}
    for f in fields(Config):
        scripts = f.metadata.get("scripts", ())  # none: not a flag (Config.script)
        if not scripts or (script is not None and script not in scripts):
            continue
        group = f.metadata["group"]
        groups[group] = groups.get(group) or parser.add_argument_group(group)
        groups[group].add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"],
                                   **f.metadata["argparse"])  # fmt: skip
    return parser


class Refused(Exception):
    """A value the command line's checks refuse (admitted's parser raises it in place of exiting)."""


class ValueParser(argparse.ArgumentParser):
    """argparse raising Refused with the reason alone ("must be a finite number"), for admitted to word."""

    def error(self, message):
        raise Refused(message.split(": ", 1)[-1])


@cache
def value_parser() -> ValueParser:
    """Every Config field as a flag, of whichever script: the checks a value passes wherever it comes from."""
    return add_flags(ValueParser(add_help=False, allow_abbrev=False), script=None)


def as_typed(name: str, value) -> list[str]:
    """The command-line words that give field `name` the value `value`; Refused for what no typing gives."""
    option = "--" + name.replace("_", "-")
    action = Config.__dataclass_fields__[name].metadata["argparse"].get("action")
    if value is None and Config.default(name) is None:
        return []
    if action in ("store_true", argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise Refused("must be true or false")
        return [option] if value else ([] if action == "store_true" else ["--no-" + option[2:]])
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise Refused("must be a number or a word, as typed on the command line")
    return [f"{option}={repr(value) if isinstance(value, float) else value}"]


def admitted(values: dict, source: str) -> dict:
    """`values` from `source` through the command line's checks, as if typed there; else UserError naming them."""
    checked = {}
    for name, value in values.items():
        try:
            checked[name] = getattr(value_parser().parse_args(as_typed(name, value)), name)
        except Refused as refusal:
            raise UserError(f"{source}: --{name.replace('_', '-')} {json.dumps(value)}: {refusal}") from None
    return checked


def parse_config(script: str, description: str, argv=None) -> Config:
    """The command line as a Config: --config's run first, then --demo's quick settings, then the flags given."""
    parser = add_flags(Parser(description=description, formatter_class=HelpFormatter), script)
    parser.add_argument("--config", type=Path, help="start with the recipe and data of a run's args.json "
                        "(RUN/args.json); flags given here still win")  # fmt: skip
    given = parser.parse_args(argv)
    defaults = (DEMO_DEFAULTS if given.demo else {}) | (recipe_of(given.config) if given.config is not None else {})
    if defaults:
        parser.set_defaults(**defaults)
        given = parser.parse_args(argv)
    del given.config
    if given.weight_decay is None:
        given.weight_decay = WEIGHT_DECAY[given.opt]
    config = Config(**vars(given), script=script)
    if config.warmup_epochs >= config.epochs:
        parser.error(f"--warmup-epochs {config.warmup_epochs} leaves no epoch of --epochs {config.epochs} to decay")
    if config.batches == "device" and (config.auto_augment != "none" or config.random_erase > 0):
        switch = "--auto-augment" if config.auto_augment != "none" else "--random-erase"
        parser.error(f"--batches device: {switch} has no batched form on the device; leave --batches to auto")
    if config.grad_checkpointing or config.layer_decay != 1:  # a model without them: one line, before anything starts
        check_model_options(config.model, config.grad_checkpointing, config.layer_decay)
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
    wanted = (*Config.recipe_fields(), "data_path", "demo")
    return admitted({name: record[name] for name in wanted if name in record}, f"--config {path}")
