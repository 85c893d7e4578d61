"""What fits in the device's memory: the largest micro-batch a training pass can take (`--micro-batch auto`,
measured by autotune/choose.py before training), and the one line an out-of-memory error during training ends in.

A step's batch is the recipe (`--batch-size`, with the learning rate and the schedule that go with it); how many of
its images a forward and backward pass takes at once is not: a batch larger than the micro-batch is taken in
pieces whose gradients add up to the batch's (train_eval_utils.train_one_epoch). So the largest micro-batch that
fits is found by trying: a pass that runs out of memory raises torch.OutOfMemoryError, its memory is given back,
and a smaller one is tried. Only a GPU has an allocator limit to hit (`memory_limited`); a CPU takes the whole
batch, and the tests substitute the out-of-memory condition to check the search there.
"""

import contextlib

import torch

from network.architectures import unwrapped
from utils import UserError


class OutOfMemory(UserError):
    """Training ran out of the device's memory: the one line names --micro-batch and a size that fits."""


def memory_limited(device: torch.device) -> bool:
    """Whether a training pass on `device` can run out of memory and say so (torch.OutOfMemoryError): a CUDA GPU.
    The CPU's memory is the machine's, shared with everything else, and a process that takes too much of it is
    killed rather than told."""
    return device.type == "cuda"


def largest_that_fits(fits, most: int) -> int:
    """The largest micro-batch from 1 to `most` for which `fits(size)` is true (a bisection: a size fits if any
    larger one does); 0 where not even one image fits. `most` is tried first: the whole batch usually fits."""
    if fits(most):
        return most
    low, high = 0, most  # low fits (0: trivially), high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def pass_fits(model, choice, images: torch.Tensor, reserve: int = 0, train: bool = False) -> bool:
    """Whether a forward and backward pass of `model` over `images` (in `choice`'s precision) fits in the
    device's memory alongside `reserve` more bytes (what training holds besides, which the pass would not
    allocate: an optimizer's moments, DDP's gradient buckets). The gradients it makes are dropped and its memory
    given back either way. In eval mode unless `train` (a model of the run's own, whose statistics may change):
    BatchNorm then leaves its statistics alone, and SyncBatchNorm exchanges nothing with the other processes."""
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
    """A training pass over `images`; if it runs out of the device's memory, OutOfMemory in one line naming the
    micro-batch it tried and the largest that fits now (found by trying smaller passes of the same images with
    the network alone), instead of the allocator's traceback. The run's checkpoint is the last epoch's."""
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
    advice = (
        f"--micro-batch {fitting} fits now (or --micro-batch auto measures at the start)"
        if fitting
        else "not even one image fits: a smaller --img-size, --grad-checkpointing or another device"
    )
    raise OutOfMemory(
        f"out of memory on {images.device} training micro-batches of {size} images: {advice}; "
        "continue with --resume RUN/checkpoint.pth and that flag (the last epoch's checkpoint)"
    )
