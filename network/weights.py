"""Weights files: the one `--weights` names (pretrained, downloaded once, or a path), read safely and loaded."""

import http.client
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse

import torch
from filelock import FileLock
from torch import nn
from torchvision.models import get_model_weights

from network.architectures import DEFAULT_MODEL, IMAGENET, TIMM, WRAPPERS, check_model_name, head_names, is_timm
from read_back import followed, safe_load
from utils import UserError

# Each connection attempt and read (torch.hub sets no timeout: a stalled read would hang for ever); pip's default.
DOWNLOAD_TIMEOUT_S = 15


def weights_file(spec: str | os.PathLike, name: str = DEFAULT_MODEL) -> Path:
    """The file `--weights spec` names: IMAGENET's pretrained weights (downloaded if not cached), or a path."""
    if isinstance(spec, str) and spec == IMAGENET:
        if is_timm(name):
            return timm_weights_file(name)
        return imagenet_weights_file(get_model_weights(check_model_name(name)).DEFAULT.url)
    return Path(spec)


def imagenet_weights_file(url: str) -> Path:
    """torchvision's weights from `url` in its cache, downloaded if not there; UserError saying where to put them."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    if path.is_file():
        return path
    hash_match = torch.hub.HASH_REGEX.search(path.name)
    fetch_by_hand = f"fetch {url} and put it at {path}"
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # taken by the sockets urllib opens inside torch.hub
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.parent / f".{path.name}.lock"):
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
    """timm's pretrained weights for timm/NAME in Hugging Face's cache, downloaded if not there; UserError if none."""
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
        raise UserError(f"cannot download timm's pretrained weights for {name} (no network? {reason}): fetch {url} "
                        "and give it as --weights FILE") from None  # fmt: skip


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped_shape: list[str] = field(default_factory=list)  # e.g. the 1000-class ImageNet head
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors"]
        for label, names in (("skipped for a different shape", self.skipped_shape),
                             ("missing from the file (left as initialised)", self.missing),
                             ("in the file but not in the model (ignored)", self.unexpected)):  # fmt: skip
            if names:
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                parts.append(f"{len(names)} {label}: {shown}")
        return "; ".join(parts)


def read_state_dict(path) -> dict:
    """A state dict from a weights file (plain, under "model" or "state_dict", or .safetensors), unwrapped."""
    data = read_safetensors(path) if Path(path).suffix == ".safetensors" else safe_load(path, "weights file")
    for key in ("model", "state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = followed(data[key], path)  # a checkpoint's weights, in it or in the file it names
            break
    if not isinstance(data, dict) or not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UserError(f"weights file {path} does not hold a state dict (a mapping of names to tensors)")
    return {WRAPPERS.sub("", name): tensor for name, tensor in data.items()}


def load_weights(model: nn.Module, source, strict: bool = False, name: str = DEFAULT_MODEL,
                 what: str | None = None) -> LoadReport:  # fmt: skip
    """Load a weights file (or a state dict read from one: `what` names it) into `model`. Lenient (--weights): a head
    of another shape is left as initialised, any other misfit refused. Strict (a run's own weights): all must fit."""
    state_dict = source if isinstance(source, dict) else read_state_dict(source)
    own, report = model.state_dict(), LoadReport()
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
        # Only the head may differ; files before torchvision 0.4.1 (resnet34-333f7ec4.pth) lack num_batches_tracked
        head, unloaded = head_names(name), report.missing + report.skipped_shape
        misfits = [key for key in unloaded if key not in head and not key.endswith("num_batches_tracked")]
    if misfits:
        raise UserError(f"{what} does not fit {name}: {len(misfits)} tensors missing, extra or of another shape "
                        f"({', '.join(misfits[:3])}{', ...' if len(misfits) > 3 else ''}); is it for another "
                        "architecture?")  # fmt: skip
    model.load_state_dict({key: state_dict[key] for key in report.loaded}, strict=strict)
    return report


def read_safetensors(path) -> dict:
    """A .safetensors file's tensors (nothing in one can run code)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise UserError(f"weights file {path} {'is a folder' if Path(path).is_dir() else 'does not exist'}")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as error:
        raise UserError(f"weights file {path} cannot be read as a safetensors file ({error})") from None


def head_classes(state_dict: dict, name: str = DEFAULT_MODEL) -> int | None:
    """The number of classes the weights' head (for model `name`) predicts, or None if they hold none."""
    head = [state_dict[key] for key in sorted(head_names(name)) if key in state_dict]
    return head[0].shape[0] if head else None
