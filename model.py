"""The network (any torchvision classification model, ResNet-34 by default, or any of timm's as `timm/NAME`),
finding the weights file `--weights` names (that model's pretrained weights from torchvision's or Hugging Face's
cache, downloaded there once), loading pretrained or previously saved weights into it, and what the training
options need to know of its architecture: which blocks gradient checkpointing recomputes, the order of its layers
(layer-wise learning-rate decay), which of its parameters are norms and biases (their own weight decay).

Every architecture-specific name lives here. The one that differs most between models is the classifier head
(`fc` in a ResNet, `classifier.3` in MobileNetV3, `heads.head` in a ViT): `head_names` finds it for any model as
the tensors whose shape changes with the number of classes, so replacing, freezing around and loading past the
head need no table of models. timm's models say the rest themselves (set_grad_checkpointing, group_matcher,
no_weight_decay); for torchvision's, two small tables below name where each family keeps its blocks.
"""

import difflib
import functools
import http.client
import os
import socket
import types
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse

import torch
import torchvision
from filelock import FileLock
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from torchvision.models import get_model, get_model_weights, list_models

from utils import UserError, safe_load

# Prefixes that wrappers add to parameter names: DataParallel/DDP ("module.") and torch.compile ("_orig_mod.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
DEFAULT_MODEL = "resnet34"
# The models with a second, auxiliary classifier, whose training-mode output is a tuple: built without it here
# (its ImageNet tensors are then ignored when loading).
BUILD_OPTIONS = {name: {"aux_logits": False, "init_weights": True} for name in ("googlenet", "inception_v3")}

IMAGENET = "imagenet"  # `--weights imagenet`: the model's pretrained weights (torchvision's ImageNet-1K, timm's own)
TIMM = "timm/"  # `--model timm/NAME`: timm's model NAME (as Hugging Face names timm's weights: timm/resnet50.a1_in1k)
# torch.hub sets no timeout of its own, so a network that drops packets would hang the download for minutes (a
# stalled read, for ever). This bounds each connection attempt and each read; pip's default is the same.
DOWNLOAD_TIMEOUT_S = 15


def model_names() -> list[str]:
    """torchvision's classification models (alexnet ... wide_resnet101_2), the choices of --model."""
    return list_models(module=torchvision.models)


def is_timm(name: str) -> bool:
    return name.startswith(TIMM)


def unknown_model(name: str) -> str | None:
    """Why `name` names no model we can build, in a few words (None: it names one): a torchvision classification
    model, or timm/ and one of timm's (timm.list_models(), with a pretrained tag if any: timm/resnet50.a1_in1k)."""
    if name in model_names():
        return None
    if not is_timm(name):
        return (
            f"{name} is not a torchvision classification model (choose from {', '.join(model_names())}) "
            f"nor {TIMM}NAME, one of timm's"
        )
    import timm  # here: only timm's models need it (0.4 s more at start-up)
    from timm.models import get_arch_pretrained_cfgs

    timm_name = name.removeprefix(TIMM)
    architecture, _, tag = timm_name.partition(".")
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models(), n=3)
        hint = f"close: {', '.join(close)}; " if close else ""
        return f"timm has no model {architecture} ({hint}timm.list_models() lists them)"
    tags = [known.partition(".")[2] for known in get_arch_pretrained_cfgs(architecture)]
    if tag and tag not in tags:
        return f"timm's {architecture} has no pretrained tag {tag} (it has {', '.join(tags) or 'none'})"
    return None


def check_model_name(name: str) -> str:
    if reason := unknown_model(name):
        raise UserError(f"--model {reason}")
    return name


def create_model(num_classes: int, name: str = DEFAULT_MODEL) -> nn.Module:
    """torchvision's or timm's `name` with a freshly initialised head of `num_classes` outputs."""
    if is_timm(check_model_name(name)):
        import timm

        return timm.create_model(name.removeprefix(TIMM), num_classes=num_classes)
    return get_model(name, num_classes=num_classes, **BUILD_OPTIONS.get(name, {}))


def model_skeleton(name: str, num_classes: int = 2) -> nn.Module:
    """The model `name` without memory: its tensors on the meta device, neither allocated nor initialised, for
    what its structure says. (RegNet's constructor computes with tensors, which the meta device does not: it is
    built on the CPU.)"""
    try:
        with torch.device("meta"):
            return create_model(num_classes, name)
    except NotImplementedError:
        return create_model(num_classes, name)


@functools.cache
def head_names(name: str = DEFAULT_MODEL) -> frozenset[str]:
    """The names of the model's classifier tensors: those whose shape depends on the number of classes.

    Found by building the model (without memory: model_skeleton) for two class counts and comparing.
    """
    two, three = (model_skeleton(name, classes).state_dict() for classes in (2, 3))
    return frozenset(key for key, tensor in two.items() if tensor.shape != three[key].shape)


@functools.cache
def random_draws(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """What the model draws at random in its forward pass while training (its dropout and stochastic depth
    layers, by class name: torch's and torchvision's keep the rate in `p`, timm's DropPath in `drop_prob`, and
    timm's models and heads that call dropout as a function in `drop_rate`), found by building it without memory:
    () for a network whose steps are a function of its weights and batch alone."""
    rates = ("p", "drop_prob", "drop_rate")
    return layer_kinds(name, lambda layer: any(getattr(layer, rate, 0) for rate in rates))


@functools.cache
def batch_statistics(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """The model's layers that normalise by the statistics of the images of a forward pass (BatchNorm, timm's
    BatchNormAct2d, ...), by class name: () for a network whose steps do not depend on how a batch is split."""
    return layer_kinds(name, lambda layer: isinstance(layer, _BatchNorm))


def layer_kinds(name: str, which) -> tuple[str, ...]:
    """The class names of the layers of model `name` for which `which(layer)` is true, built without memory."""
    return tuple(sorted({type(layer).__name__ for layer in model_skeleton(name).modules() if which(layer)}))


def weights_file(spec: str | os.PathLike, name: str = DEFAULT_MODEL) -> Path:
    """The file that `--weights spec` names for model `name`, for load_weights.

    The word "imagenet" (IMAGENET, as a str) names the model's pretrained weights: torchvision's ImageNet weights
    (imagenet_weights_file, which downloads them if they are not cached yet), or for a timm model timm's
    (timm_weights_file). Anything else is a path, returned as it is (load_weights says so when it does not
    exist); a file that is really called "imagenet" is `./imagenet`.
    """
    if isinstance(spec, str) and spec == IMAGENET:
        return timm_weights_file(name) if is_timm(name) else imagenet_weights_file(imagenet_weights_url(name))
    return Path(spec)


def imagenet_weights_url(name: str = DEFAULT_MODEL) -> str:
    """Where torchvision keeps its ImageNet weights for model `name` (its DEFAULT, the best of them)."""
    return get_model_weights(check_model_name(name)).DEFAULT.url


def imagenet_weights_file(url: str) -> Path:
    """torchvision's ImageNet weights file in torchvision's cache, downloaded from `url` first if not there yet.

    The cache is the one torchvision's own `weights.get_state_dict()` uses: torch.hub.get_dir()/checkpoints
    (~/.cache/torch/hub/checkpoints unless TORCH_HOME or XDG_CACHE_HOME say otherwise), the file named as in the
    URL. The download is torch.hub's, with torchvision's check that the file's sha256 starts with the hash in its
    name; it writes to a temporary file beside the real one and renames it when complete (deleting it on
    failure), so a failed or interrupted download never leaves a file under the real name.

    Call it before training starts (the scripts do, in run/plan.py's prepare), so that a missing network is one
    error line at start-up. Processes that ask at the same time (every torchrun rank runs prepare) take turns
    on a lock file beside the cache file: one downloads, the others then find the file.

    Raises UserError when the download fails (no network, a timeout, a file that is not the expected one),
    saying where to fetch the file from and where to put it.
    """
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    if path.is_file():
        return path
    hash_match = torch.hub.HASH_REGEX.search(path.name)
    fetch_by_hand = f"fetch {url} and put it at {path}"
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # taken by the sockets urllib opens inside torch.hub
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.parent / f".{path.name}.lock"):  # filelock: flock on Linux and macOS, msvcrt on Windows
            if not path.is_file():  # else another process downloaded it while we waited
                print(f"Downloading {url} to {path}", flush=True)
                torch.hub.download_url_to_file(url, str(path), hash_match.group(1) if hash_match else None)
    except (OSError, http.client.HTTPException) as error:  # URLError, refused, reset, timed out: all OSErrors
        reason = error.reason if isinstance(error, URLError) and not isinstance(error, HTTPError) else error
        raise UserError(f"cannot download ImageNet weights (no network? {reason}): {fetch_by_hand}") from None
    except RuntimeError as error:  # torch.hub's hash check: a proxy's error page, a truncated file, ...
        if "invalid hash value" not in str(error):
            raise
        raise UserError(f"the file downloaded from {url} is not the expected one ({error}): {fetch_by_hand}") from None
    finally:
        socket.setdefaulttimeout(previous_timeout)
    return path


def timm_weights_file(name: str) -> Path:
    """timm's pretrained weights for timm/NAME (those of NAME's tag, else timm's default for the architecture) in
    Hugging Face's cache, where timm itself keeps them: downloaded there first if they are not there yet.

    Looked up in the cache alone first, so that a cached file needs no network; then, after one request that
    finds whether the file can be had, downloaded by huggingface_hub, which bounds each connection and read (10 s:
    HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT), writes to an incomplete file it renames when whole, and lets
    concurrent processes (torchrun's ranks) take turns on a lock. HF_HUB_OFFLINE=1 forbids the download. Raises
    UserError when the model has no pretrained weights or the download fails, saying where to fetch the file from
    and to pass it as --weights FILE.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HTTPError
    from timm.models import get_pretrained_cfg

    config = get_pretrained_cfg(name.removeprefix(TIMM))
    if config is None or not config.hf_hub_id:
        raise UserError(f"timm has no pretrained weights for --model {name}: give --weights FILE, or none")
    repo, _, revision = config.hf_hub_id.partition("@")
    where = {"repo_id": repo, "filename": config.hf_hub_filename or "model.safetensors", "revision": revision or None}
    cached = try_to_load_from_cache(**where)  # the cache alone (hf_hub_download would ask the Hub something first)
    if isinstance(cached, str):
        return Path(cached)
    url = hf_hub_url(**where)
    try:
        get_hf_file_metadata(url)  # one request, not retried: without a network it fails at once, not in 20 s
        print(f"Downloading {url} to Hugging Face's cache", flush=True)
        return Path(hf_hub_download(**where))
    except (OSError, HTTPError) as error:  # no network, HF_HUB_OFFLINE, a timeout, a missing file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(
            f"cannot download timm's pretrained weights for {name} (no network? {reason}): fetch {url} and give "
            "it as --weights FILE"
        ) from None


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped_shape: list[str] = field(default_factory=list)  # e.g. the 1000-class ImageNet head
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors"]
        for label, names in (
            ("skipped for a different shape", self.skipped_shape),
            ("missing from the file (left as initialised)", self.missing),
            ("in the file but not in the model (ignored)", self.unexpected),
        ):
            if names:
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                parts.append(f"{len(names)} {label}: {shown}")
        return "; ".join(parts)


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    def strip(name: str) -> str:
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        return name

    return {strip(name): tensor for name, tensor in state_dict.items()}


def read_state_dict(path) -> dict:
    """A state dict from a weights file: a plain state dict, a checkpoint holding one under "model" (ours) or
    "state_dict" (timm's training script's), or a .safetensors file (Hugging Face's, timm's pretrained weights)."""
    data = read_safetensors(path) if Path(path).suffix == ".safetensors" else safe_load(path, "weights file")
    for key in ("model", "state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UserError(f"weights file {path} does not hold a state dict (a mapping of names to tensors)")
    return strip_wrapper_prefixes(data)


def load_weights(
    model: nn.Module, source, strict: bool = False, name: str = DEFAULT_MODEL, what: str | None = None
) -> LoadReport:
    """Load a weights file (or a state dict read from one: `what` names it) into `model`, torchvision's `name`;
    returns what was loaded and skipped.

    Lenient (for --weights, starting a run): tensors of another shape, normally a head for another number of
    classes, are skipped and left as initialised; anything else that does not fit is refused. Strict (for a run's
    own weights, in inference): every tensor must be there, with the model's shape.
    """
    state_dict = source if isinstance(source, dict) else read_state_dict(source)
    own = model.state_dict()
    report = LoadReport()
    for key, tensor in state_dict.items():
        if key not in own:
            report.unexpected.append(key)
        elif own[key].shape != tensor.shape:
            report.skipped_shape.append(key)
        else:
            report.loaded.append(key)
    report.missing = [key for key in own if key not in state_dict]
    what = what or (f"weights file {source}" if not isinstance(source, dict) else "the weights")
    if strict:
        misfits = report.missing + report.unexpected + report.skipped_shape
    else:
        if not report.loaded:
            raise UserError(f"{what} has no tensor that fits this model (is it for another architecture?)")
        # Only the classifier head may differ (another class count); files older than torchvision 0.4.1 (such as
        # resnet34-333f7ec4.pth) lack the num_batches_tracked counters. Anything else means another network.
        head = head_names(name)
        misfits = [
            key
            for key in report.missing + report.skipped_shape
            if key not in head and not key.endswith("num_batches_tracked")
        ]
    if misfits:
        raise UserError(
            f"{what} does not fit {name}: {len(misfits)} tensors missing, extra or of another shape "
            f"({', '.join(misfits[:3])}{', ...' if len(misfits) > 3 else ''}); is it for another architecture?"
        )
    model.load_state_dict({key: state_dict[key] for key in report.loaded}, strict=strict)
    return report


def read_safetensors(path) -> dict:
    """A .safetensors file's tensors (a format that holds tensors alone: nothing in it can run code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise UserError(f"weights file {path} {'is a folder' if Path(path).is_dir() else 'does not exist'}")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as error:
        raise UserError(f"weights file {path} cannot be read as a safetensors file ({error})") from None


def head_classes(state_dict: dict, name: str = DEFAULT_MODEL) -> int | None:
    """The number of classes the weights' classifier head (for model `name`) predicts, or None if they hold none."""
    head = [state_dict[key] for key in sorted(head_names(name)) if key in state_dict]
    return head[0].shape[0] if head else None


def freeze_all_but_head(model: nn.Module, name: str = DEFAULT_MODEL) -> None:
    """Train only the classifier head (transfer learning from pretrained features)."""
    head = head_names(name)
    for key, parameter in model.named_parameters():
        parameter.requires_grad_(key in head)


def initial_model(
    name: str,
    num_classes: int,
    device: torch.device,
    memory_format: torch.memory_format = torch.contiguous_format,
    *,
    seed: int = 0,
    weights: Path | None = None,
    freeze: bool = False,
    grad_checkpointing: bool = False,
) -> nn.Module:
    """The model `name` as a run starts it: seeded (the same initial weights in every process), then `weights`
    loaded into it (run/plan.py's prepare checked the file, and said what loads), all but its head frozen when
    `freeze`, its blocks recomputed in the backward pass when `grad_checkpointing`, on `device` in
    `memory_format`."""
    torch.manual_seed(seed)
    model = create_model(num_classes, name)
    if weights is not None:
        load_weights(model, weights, name=name)
    if freeze:
        freeze_all_but_head(model, name)
    if grad_checkpointing:
        enable_grad_checkpointing(model, name)
    return model.to(device, memory_format=memory_format)


def unwrapped(model: nn.Module) -> nn.Module:
    """The network inside its wrappers: DDP's and DataParallel's `module`, torch.compile's `_orig_mod`."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def check_model_options(name: str, grad_checkpointing: bool, layer_decay: float) -> None:
    """Refuse, before anything starts, --grad-checkpointing for a model without blocks known to recompute and
    --layer-decay for one whose order of layers is not known (UserError, one line); built without memory."""
    model = model_skeleton(name)
    if grad_checkpointing:
        enable_grad_checkpointing(model, name)
    if layer_decay != 1:
        layer_scales(model, name, layer_decay)


def check_input_size(name: str, img_size: int) -> None:
    """Refuse, before anything starts, an --img-size the model cannot take (a ViT's fixed size, say): one image of
    that size through the model without memory (model_skeleton, in eval mode: a batch of one is fine there), and
    the model's own refusal, in one line. Where the meta device cannot run the model, its first step will tell."""
    model = sizing_skeleton(name)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, img_size, img_size, device=device))
    except NotImplementedError:
        return
    except (AssertionError, RuntimeError, ValueError) as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"--model {name} does not take --img-size {img_size} images: {said}") from None


@functools.cache
def sizing_skeleton(name: str) -> nn.Module:
    """model_skeleton(name) in eval mode, built once (check_input_size asks for every configuration checked)."""
    return model_skeleton(name).eval()


# --- gradient checkpointing --------------------------------------------------------------------------------------

# torchvision's families whose blocks are known: the nn.Sequential(s) that hold them, one block after another.
FEATURES = ("AlexNet", "ConvNeXt", "DenseNet", "EfficientNet", "MobileNetV2", "MobileNetV3", "SqueezeNet", "VGG")
BLOCK_SEQUENCES = {
    "ResNet": ("layer1", "layer2", "layer3", "layer4"),
    "RegNet": ("trunk_output",),
    "ShuffleNetV2": ("stage2", "stage3", "stage4"),
    "MNASNet": ("layers",),
    "VisionTransformer": ("encoder.layers",),
    **dict.fromkeys(("SwinTransformer", *FEATURES), ("features",)),
}


def enable_grad_checkpointing(model: nn.Module, name: str) -> nn.Module:
    """Make `model` (torchvision's or timm's `name`) keep only each block's input from the forward pass and
    recompute the block's activations in the backward pass: less memory for one more forward pass of each block.

    torch's non-reentrant checkpoint (use_reentrant=False), which DDP and no_sync take as any backward pass, and
    which restores the random state for the recomputation (preserve_rng_state), so dropout and stochastic depth
    draw the same masks again: the gradients are those of the plain model. timm's models checkpoint their own
    blocks (set_grad_checkpointing); torchvision's have theirs wrapped here, in the sequences BLOCK_SEQUENCES names.
    Parameter names, and so weights files, stay as they are. UserError where no blocks are known.

    The recomputation would update BatchNorm's running statistics a second time (torch's checkpoint does not
    know BatchNorm: pytorch/pytorch#96136): they are frozen from the end of each training forward pass until its
    backward pass has computed every gradient (hooks on `model` and its parameters), so a step updates them once,
    as without checkpointing.
    """
    if is_timm(name):
        from timm.layers import set_reentrant_ckpt

        set_reentrant_ckpt(False)  # non-reentrant, whatever TIMM_REENTRANT_CKPT says
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError, AttributeError) as refusal:
            raise UserError(
                f"--grad-checkpointing: timm's {name.removeprefix(TIMM)} does not support it ({refusal})"
            ) from None
    else:
        paths = BLOCK_SEQUENCES.get(type(model).__name__)
        if paths is None:
            known = ", ".join(sorted(BLOCK_SEQUENCES))
            raise UserError(
                f"--grad-checkpointing: {name}'s blocks are not known here (they are for torchvision's {known}, "
                f"and for timm's models)"
            )
        for path in paths:
            checkpoint_blocks(model.get_submodule(path))
    model.register_forward_hook(running_statistics_off)
    model.register_forward_pre_hook(running_statistics_on)  # if no backward pass came after the last forward pass
    return model


def checkpoint_blocks(sequence: nn.Sequential) -> None:
    """Run `sequence`'s children in checkpointed runs: each child with parameters (a block, or a single layer
    such as a convolution) starts a run, and the parameterless layers after it (activation, pooling) join it. A
    child that is itself a plain sequence of blocks (a stage) checkpoints its own blocks instead. A run that
    would start with an in-place layer, which would change the input kept for its recomputation, is not
    checkpointed. Its forward is replaced on the instance: the children, and so the parameter names, stay."""
    runs = []  # (checkpointed?, the names of the children it runs)
    for child_name, child in sequence.named_children():
        if is_sequence_of_blocks(child):
            checkpoint_blocks(child)
            runs.append((False, [child_name]))
        elif runs and runs[-1][0] and not any(True for _ in child.parameters()):
            runs[-1][1].append(child_name)
        else:
            runs.append((not getattr(child, "inplace", False), [child_name]))
    sequence.checkpointed_runs = runs
    sequence.forward = types.MethodType(forward_in_checkpointed_runs, sequence)


def is_sequence_of_blocks(module: nn.Module) -> bool:
    """A stage: an nn.Sequential that runs its children in order and whose every child has children itself."""
    children = list(module.children())
    return (
        isinstance(module, nn.Sequential)
        and type(module).forward is nn.Sequential.forward
        and bool(children)
        and all(any(True for _ in child.children()) for child in children)
    )


def forward_in_checkpointed_runs(self: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """nn.Sequential's forward, each run of checkpoint_blocks recomputed in the backward pass."""
    for checkpointed, names in self.checkpointed_runs:
        layers = [self._modules[name] for name in names]  # looked up each time: SyncBatchNorm replaces layers
        if checkpointed and torch.is_grad_enabled():
            x = checkpoint(run_layers, layers, x, use_reentrant=False, preserve_rng_state=True)
        else:
            x = run_layers(layers, x)
    return x


def run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def running_statistics_on(model: nn.Module, *forward_args) -> None:
    """The BatchNorm layers that running_statistics_off froze update their statistics again, their count of
    batches as it was at the end of the forward pass (a hook: after the backward pass, before a forward pass)."""
    for layer in model.modules():
        if hasattr(layer, "momentum_while_frozen"):
            layer.momentum = layer.__dict__.pop("momentum_while_frozen")
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(layer.__dict__.pop("batches_while_frozen"))


def running_statistics_off(model: nn.Module, args, output) -> None:
    """Forward hook: after a training forward pass, each BatchNorm layer keeps its running statistics as they are
    (momentum 0: an update leaves them; its count of batches, kept aside, is put back after) until the backward
    pass has computed every gradient, its recomputations done: then running_statistics_on, before anything reads
    them (the EMA, a checkpoint). (Not track_running_stats=False: BatchNorm would then save other tensors for its
    backward pass than in the forward pass, which the checkpoint refuses.)"""
    if not (model.training and torch.is_grad_enabled()):
        return
    for layer in model.modules():
        if isinstance(layer, _BatchNorm) and layer.track_running_stats and not hasattr(layer, "momentum_while_frozen"):
            layer.momentum_while_frozen, layer.momentum = layer.momentum, 0.0
            if layer.num_batches_tracked is not None:
                layer.batches_while_frozen = layer.num_batches_tracked.clone()  # on the device: nothing waits
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if trained:  # a hook of this backward pass alone (a parameter's hooks go when .to() replaces its data)

        def backward_done(gradients) -> None:
            running_statistics_on(model)
            handle.remove()

        handle = register_multi_grad_hook(trained, backward_done, mode="all")


# --- parameter groups: layer-wise learning-rate decay, weight decay of norms and biases -------------------------

# torchvision's families whose layers run in a known order, from the input: each entry one layer ("a b": a and b
# together; "x.*": each child of x that has parameters, one layer each). Every parameter after them is the head's.
LAYERS = {
    "ResNet": ("conv1 bn1", "layer1", "layer2", "layer3", "layer4"),
    "RegNet": ("stem", "trunk_output.*"),
    "ShuffleNetV2": ("conv1", "stage2", "stage3", "stage4", "conv5"),
    "MNASNet": ("layers.*",),
    "VisionTransformer": ("conv_proj class_token encoder.pos_embedding", "encoder.layers.*"),
    **dict.fromkeys(("SwinTransformer", *FEATURES), ("features.*",)),
}
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)


def layer_scales(model: nn.Module, name: str, layer_decay: float) -> dict[str, float]:
    """Each parameter's share of the learning rate under layer-wise decay by `layer_decay` (by name, of `model`
    unwrapped): the head's 1, each layer before it `layer_decay` times the next one's.

    timm's models: timm's own layers (param_groups_layer_decay, from the model's group_matcher: a ResNet's stem and
    stages, a ViT's embedding and blocks). torchvision's: the layers LAYERS names. UserError for a model whose
    order of layers is not known (a timm model without group_matcher, a torchvision family not in LAYERS).
    """
    if is_timm(name):
        from timm.optim import param_groups_layer_decay

        if not hasattr(model, "group_matcher"):
            raise UserError(f"--layer-decay: timm's {name.removeprefix(TIMM)} does not say the order of its layers")
        groups = param_groups_layer_decay(model, weight_decay=0.0, layer_decay=layer_decay)
        scale_of = {id(parameter): group["lr_scale"] for group in groups for parameter in group["params"]}
        return {key: scale_of.get(id(parameter), 1.0) for key, parameter in model.named_parameters()}
    layers = LAYERS.get(type(model).__name__)
    if layers is None:
        raise UserError(
            f"--layer-decay: the order of {name}'s layers is not known here (it is for torchvision's "
            f"{', '.join(sorted(LAYERS))}, and for timm's models)"
        )
    prefixes = []  # each layer's prefixes, from the input
    for layer in layers:
        if layer.endswith(".*"):
            parent = layer.removesuffix(".*")
            children = model.get_submodule(parent).named_children()
            prefixes += [[f"{parent}.{child}"] for child, module in children if any(True for _ in module.parameters())]
        else:
            prefixes.append(layer.split())
    scales = {}
    for key, _ in model.named_parameters():
        depth = next(
            (i for i, layer in enumerate(prefixes) for p in layer if key == p or key.startswith(p + ".")), None
        )
        scales[key] = 1.0 if depth is None else layer_decay ** (len(prefixes) - depth)
    return scales


def norms_and_biases(model: nn.Module, name: str) -> frozenset[str]:
    """The names of `model`'s (unwrapped) parameters that --norm-weight-decay applies to: torchvision's models,
    the weights of its normalisation layers (BatchNorm, LayerNorm, GroupNorm, ...) and every bias, as torchvision's
    references choose them; timm's, timm's own choice (param_groups_weight_decay): every 1-D tensor (norms,
    biases, layer scales) and what the model's no_weight_decay() names (a ViT's position embedding and class
    token)."""
    if is_timm(name):
        from timm.optim import param_groups_weight_decay

        exempt = getattr(model, "no_weight_decay", set)()
        groups = param_groups_weight_decay(model, weight_decay=1.0, no_weight_decay_list=exempt)
        without = {id(parameter) for group in groups if group["weight_decay"] == 0 for parameter in group["params"]}
        return frozenset(key for key, parameter in model.named_parameters() if id(parameter) in without)
    found = {key for key, _ in model.named_parameters() if key.rpartition(".")[2] == "bias"}
    for prefix, layer in model.named_modules():
        if isinstance(layer, NORMS):
            found |= {f"{prefix}.{key}" if prefix else key for key, _ in layer.named_parameters(recurse=False)}
    return frozenset(found)


def data_parallel_over_gpus(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over every visible GPU, `device` first (it gathers the outputs and holds the master copy);
    the model itself where there is only one device to run on."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        print(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    print(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])
