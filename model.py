"""The network (any torchvision classification model; ResNet-34 by default), finding the weights file `--weights`
names (that model's ImageNet weights from torchvision's cache, downloaded there once), and loading pretrained or
previously saved weights into it.

Every architecture-specific name lives here. The one that differs most between models is the classifier head
(`fc` in a ResNet, `classifier.3` in MobileNetV3, `heads.head` in a ViT): `head_names` finds it for any model as
the tensors whose shape changes with the number of classes, so replacing, freezing around and loading past the
head need no table of models.
"""

import functools
import http.client
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse

import torch
import torchvision
from filelock import FileLock
from torch import nn
from torchvision.models import get_model, get_model_weights, list_models

from utils import UserError, safe_load

# Prefixes that wrappers add to parameter names: DataParallel/DDP ("module.") and torch.compile ("_orig_mod.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
DEFAULT_MODEL = "resnet34"
# The models with a second, auxiliary classifier, whose training-mode output is a tuple: built without it here
# (its ImageNet tensors are then ignored when loading).
BUILD_OPTIONS = {name: {"aux_logits": False, "init_weights": True} for name in ("googlenet", "inception_v3")}

IMAGENET = "imagenet"  # `--weights imagenet`: torchvision's ImageNet-1K weights for the model
# torch.hub sets no timeout of its own, so a network that drops packets would hang the download for minutes (a
# stalled read, for ever). This bounds each connection attempt and each read; pip's default is the same.
DOWNLOAD_TIMEOUT_S = 15


def model_names() -> list[str]:
    """torchvision's classification models (alexnet ... wide_resnet101_2), the choices of --model."""
    return list_models(module=torchvision.models)


def check_model_name(name: str) -> str:
    if name not in model_names():
        raise UserError(
            f"--model {name} is not a torchvision classification model; choose from {', '.join(model_names())}"
        )
    return name


def create_model(num_classes: int, name: str = DEFAULT_MODEL) -> nn.Module:
    """torchvision's `name` with a freshly initialised head of `num_classes` outputs."""
    return get_model(check_model_name(name), num_classes=num_classes, **BUILD_OPTIONS.get(name, {}))


@functools.cache
def head_names(name: str = DEFAULT_MODEL) -> frozenset[str]:
    """The names of the model's classifier tensors: those whose shape depends on the number of classes.

    Found by building the model (without memory: on the meta device) for two class counts and comparing.
    """
    with torch.device("meta"):
        two, three = (create_model(classes, name).state_dict() for classes in (2, 3))
    return frozenset(key for key, tensor in two.items() if tensor.shape != three[key].shape)


@functools.cache
def random_draws(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """What the model draws at random in its forward pass while training (its dropout and stochastic depth
    layers, by class name), found by building it on the meta device: () for a network whose steps are a function
    of its weights and batch alone."""
    with torch.device("meta"):
        layers = create_model(2, name).modules()
    return tuple(sorted({type(layer).__name__ for layer in layers if getattr(layer, "p", 0) > 0}))


def weights_file(spec: str | os.PathLike, name: str = DEFAULT_MODEL) -> Path:
    """The file that `--weights spec` names for model `name`, for load_weights.

    The word "imagenet" (IMAGENET, as a str) names torchvision's ImageNet weights for the model: see
    imagenet_weights_file, which downloads them if they are not cached yet. Anything else is a path, returned as
    it is (load_weights says so when it does not exist); a file that is really called "imagenet" is `./imagenet`.
    """
    if isinstance(spec, str) and spec == IMAGENET:
        return imagenet_weights_file(imagenet_weights_url(name))
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
    """A state dict from a weights file: a plain state dict, or a checkpoint holding one under "model"."""
    data = safe_load(path, "weights file")
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
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
) -> nn.Module:
    """torchvision's `name` as a run starts it: seeded (the same initial weights in every process), then `weights`
    loaded into it (run/plan.py's prepare checked the file, and said what loads), all but its head frozen when
    `freeze`, on `device` in `memory_format`."""
    torch.manual_seed(seed)
    model = create_model(num_classes, name)
    if weights is not None:
        load_weights(model, weights, name=name)
    if freeze:
        freeze_all_but_head(model, name)
    return model.to(device, memory_format=memory_format)


def data_parallel_over_gpus(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over every visible GPU, `device` first (it gathers the outputs and holds the master copy);
    the model itself where there is only one device to run on."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        print(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    print(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])
