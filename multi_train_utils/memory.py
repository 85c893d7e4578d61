"""The largest micro-batch that fits (--micro-batch auto); running out of memory in one line (docs/recipes.md)."""

import contextlib

import torch

from network.architectures import unwrapped
from utils import UserError


class OutOfMemory(UserError):
    """Training ran out of the device's memory: the one line names --micro-batch and a size that fits."""


def memory_limited(device: torch.device) -> bool:
    """Whether a pass on `device` can run out of memory and say so: a CUDA GPU (on the CPU, a process is killed)."""
    return device.type == "cuda"


def largest_that_fits(fits, most: int) -> int:
    """The largest size up to `most` that `fits` (bisected, `most` first: the whole batch usually fits), 0 if none."""
    if fits(most):
        return most
    low, high = 0, most  # low fits (0: trivially), high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def pass_fits(model, choice, images: torch.Tensor, reserve: int = 0, train: bool = False) -> bool:
    """Whether a forward and backward pass fits beside `reserve` more bytes (moments, gradient buckets); all given
    back. In eval mode unless `train`, so that BatchNorm keeps its statistics and SyncBatchNorm exchanges nothing."""
    was_training = model.training
    model.train(train)
    held = None
    try:
        held = torch.empty(reserve, dtype=torch.uint8, device=images.device) if reserve else None
        with torch.enable_grad(), choice.autocast(images.device):
            model(images).float().sum().backward()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del held
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        if images.device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def out_of_memory(training, images: torch.Tensor):
    """A training pass; out of memory, OutOfMemory naming the micro-batch it tried and the largest that fits now."""
    try:
        yield
        return
    except torch.OutOfMemoryError:
        pass  # out of the handler first: the failed pass's tensors are released with its traceback
    network, size = unwrapped(training.model), len(images)
    training.optimizer.zero_grad(set_to_none=True)
    if images.device.type == "cuda":
        torch.cuda.empty_cache()
    fitting = largest_that_fits(lambda m: pass_fits(network, training.choice, images[:m]), size - 1) if size > 1 else 0
    advice = "not even one image fits: --grad-checkpointing or another --device (a smaller --img-size is a new run)"
    if fitting:
        advice = f"--micro-batch {fitting} fits now (or --micro-batch auto measures at the start)"
    raise OutOfMemory(f"out of memory on {images.device} training micro-batches of {size} images: {advice}")
