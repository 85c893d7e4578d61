"""The GPU path on a machine without a GPU: torch's fake tensors standing in for CUDA ones, and a count of what makes
the host wait for the device.

    with FakeCuda(devices=2) as cuda:
        ...  # the training code, unchanged, on torch.device("cuda")
    cuda.waits  # Counter: the host's waits for the device, by cause

Inside, torch believes it has `devices` GPUs (torch.cuda.is_available() and friends are substituted), and a tensor
made on, or moved to, a CUDA device is one of torch's FakeTensors: it has a shape, a dtype and a device, and no
values. Every operation on it runs torch's own shape and device rules (its meta kernels), so the training step runs
as on a GPU, as fast as Python goes, on any machine. What a real GPU would do differently is what this file is for:

- An operation that needs the device's values on the host, `.item()` or a tensor whose size depends on them (a
  boolean mask, nonzero, bincount), fails, as the host would wait for the device there: FakeTensor raises.
- A CPU tensor mixed into an operation on CUDA tensors fails, as it does on a GPU (FakeTensor's device rules).
- An operation whose GPU kernel asserts more of its arguments than its meta kernel checks fails as it would there
  (CUDA_KERNEL_ASSERTS: found on a real GPU, where the meta kernels let them pass).
- A copy between the host and a GPU is counted in `waits` when it blocks (non_blocking=False): the host waits for
  the device's queue to drain (to the host), or torch waits for the copy to finish (to the device, from memory
  that is not pinned). A copy to the host gives zeros: the values are not known. Copies that do not block are
  not counted.
- Pinning host memory (which needs a GPU's driver) gives plain memory: Tensor.pin_memory a copy of the tensor,
  torch.empty(pin_memory=True) in any thread an unpinned tensor.
- torch.cuda.Event and torch.cuda.current_stream are stand-ins that remember the device each event was recorded
  on (`events`); torch.cuda.Stream's remembers the events recorded on it and the waits for them (`stream_events`);
  torch.cuda.set_device is remembered (`current`); each GPU's random generator has a state of its own, and
  setting one that does not exist raises IndexError, as with that many real GPUs.

The tensors that stay on the CPU (the labels before they travel, torchvision's mixing parameters, ...) are real
and computed for real. Caches of device tensors made inside (dataset/transforms.py's normalising constants) are
emptied on the way in and out: fake tensors belong to the FakeTensorMode that made them.
"""

import collections
import contextlib

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dataset.transforms import normalising_constants

aten = torch.ops.aten


def fused_sgd_meta(params, grads, momenta, *, grad_scale=None, found_inf=None, **hyperparameters) -> None:
    """torch's fused SGD step on fake tensors (torch 2.14 has no fake kernel for it, where it has AdamW's): it
    changes no shape, so it only checks that every tensor it is given is on its parameters' device."""
    tensors = [*params, *grads, *momenta, *(t for t in (grad_scale, found_inf) if t is not None)]
    devices = {tensor.device for tensor in tensors}
    if len(devices) > 1:
        raise RuntimeError(f"_fused_sgd_: tensors on {sorted(map(str, devices))}, expected one device")


def batch_norm_update_stats_meta(input, running_mean, running_var, momentum):
    """torch.batch_norm_update_stats on fake tensors (no fake kernel in torch 2.14): the per-channel mean and
    variance, in the running statistics' dtype (float32 for lower-precision input, as on a GPU)."""
    dtype = running_mean.dtype if running_mean is not None else torch.promote_types(input.dtype, torch.float32)
    channels = input.shape[1]
    return input.new_empty(channels, dtype=dtype), input.new_empty(channels, dtype=dtype)


def batch_norm_stats_meta(input, eps):
    """torch.batch_norm_stats (torch's nn.SyncBatchNorm's first kernel) on fake tensors: per-channel mean and
    inverse standard deviation, in float32 at least."""
    dtype = torch.promote_types(input.dtype, torch.float32)
    return input.new_empty(input.shape[1], dtype=dtype), input.new_empty(input.shape[1], dtype=dtype)


# The kernels torch 2.14 lacks for fake tensors, added where it still lacks them; kept for the process's life
MISSING_FAKE_KERNELS = torch.library.Library("aten", "IMPL")
for overload, kernel in {
    "_fused_sgd_": fused_sgd_meta,
    "_fused_sgd_.tensor_lr": fused_sgd_meta,
    "batch_norm_update_stats": batch_norm_update_stats_meta,
    "batch_norm_stats": batch_norm_stats_meta,
}.items():
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{overload}", "Meta"):
        MISSING_FAKE_KERNELS.impl(overload, kernel, "Meta")


def native_batch_norm_backward_asserts(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, *rest
) -> None:
    """What CUDA's batch_norm_backward asserts of its arguments, and the CPU's and the meta kernel do not: the
    training pass's saved mean and inverse std are always given (empty tensors where the running statistics stand
    in for them); None fails an internal assertion there."""
    for name, value in (("save_mean", save_mean), ("save_invstd", save_invstd)):
        if value is None:
            raise RuntimeError(f"{name}->defined() INTERNAL ASSERT FAILED: CUDA's batch_norm_backward needs {name}")


# An operation's kernel on a GPU checks more of its arguments than its meta kernel does: those checks, run on the way
CUDA_KERNEL_ASSERTS = {aten.native_batch_norm_backward.default: native_batch_norm_backward_asserts}


class NoDeviceFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that never starts a GPU's driver, even with torch.cuda.is_available() substituted."""

    avoid_device_init = True


class FakeStream:
    """torch.cuda.Stream's stand-in: its events (record_event) and those it waits for (wait_event) go to `log` as
    (what, the stream's device, the event), in order."""

    log: list = []

    def __init__(self, device: torch.device | None = None):
        self.device = torch.device("cuda") if device is None else torch.device(device)

    def record_event(self, event=None):
        event = event or object()
        FakeStream.log.append(("record", self.device, event))
        return event

    def wait_event(self, event) -> None:
        FakeStream.log.append(("wait", self.device, event))


class FakeEvent:
    """torch.cuda.Event's stand-in: records the stream's device it was recorded on into `log`."""

    log: list = []

    def record(self, stream: FakeStream | None = None) -> None:
        FakeEvent.log.append(stream.device if stream is not None else None)

    def synchronize(self) -> None:
        pass


class FakeCuda(TorchDispatchMode):
    """See the module's docstring."""

    def __init__(self, devices: int = 1):
        super().__init__()
        self.devices = devices
        self.fake = NoDeviceFakeTensorMode(allow_non_fake_inputs=True)
        self.waits = collections.Counter()
        self.events = FakeEvent.log = []
        self.stream_events = FakeStream.log = []
        self.current = 0
        self.patches = contextlib.ExitStack()

    def __enter__(self):
        normalising_constants.cache_clear()
        cuda, patches = torch.cuda, self.patches
        for name, value in {
            "is_available": lambda: True,
            "is_bf16_supported": lambda *args, **kwargs: True,
            "current_device": lambda: self.current,
            "set_device": self.set_device,
            "current_stream": lambda device=None: FakeStream(torch.device("cuda", self.index(device))),
            "Event": FakeEvent,
            "Stream": FakeStream,
            "stream": lambda stream: contextlib.nullcontext(stream),
            "is_current_stream_capturing": lambda: False,  # (torch's nn.SyncBatchNorm asks)
        }.items():
            patches.enter_context(substituted(cuda, name, value))
        for name, value in {
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "device_count": lambda: self.devices,
        }.items():
            for owner in (cuda, torch.cuda.random):  # (get_rng_state_all and set_rng_state_all call the latter's)
                patches.enter_context(substituted(owner, name, value))
        patches.enter_context(substituted(torch.Tensor, "backward", backward))  # (see backward)
        patches.enter_context(substituted(torch.Tensor, "record_stream", lambda tensor, stream: None))
        # (any thread's: see unpinned_empty), once torch's default-device mode has cached its factories, the real
        # torch.empty among them: cached with the substitute, `with torch.device(...)` would leave tensors on the CPU
        torch.utils._device._device_constructors()
        patches.enter_context(substituted(torch, "empty", unpinned_empty))
        if hasattr(fake_tensor, "init_gpu_context"):  # torch 2.11 starts a real GPU before its first fake CUDA tensor
            patches.enter_context(substituted(fake_tensor, "init_gpu_context", lambda device: None))
        patches.enter_context(self.fake)  # beneath this mode: what reaches it is on a GPU
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.patches.close()
            normalising_constants.cache_clear()

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.full((16,), self.index(device), dtype=torch.uint8)  # a state of its own per GPU

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        """As on a machine with this many GPUs: a generator that does not exist is an IndexError."""
        index = device if isinstance(device, int) else self.index(device)
        if index >= self.devices:
            raise IndexError(f"no generator for cuda:{index}: {self.devices} GPU(s) visible")

    def set_device(self, device) -> None:
        self.current = self.index(device)

    def index(self, device) -> int:
        device = torch.device("cuda", device) if isinstance(device, int) else device
        device = torch.device(device) if isinstance(device, str) else device
        index = self.current if device is None or device.index is None else device.index
        if index >= self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (of {self.devices} fake GPUs)")
        return index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        target = kwargs.get("device")
        target = None if target is None else torch.device(target)
        on_gpu = [tensor for tensor in tensors if tensor.device.type == "cuda"]
        if func in (aten._pin_memory.default, aten.is_pinned.default):  # pinned host memory needs a GPU's driver
            with _disable_current_modes():  # a real tensor on the host
                return args[0].clone() if func is aten._pin_memory.default else False
        if not on_gpu and (target is None or target.type != "cuda"):
            with _disable_current_modes():  # host work: real tensors, computed
                return func(*args, **kwargs)
        if func in CUDA_KERNEL_ASSERTS:
            CUDA_KERNEL_ASSERTS[func](*args, **kwargs)
        copy = self.crossing(func, args, kwargs, target)
        if copy is not None:
            direction, non_blocking = copy
            if not non_blocking:
                self.waits[f"blocking copy to the {direction}"] += 1
            if direction == "host" and func is aten._to_copy.default:
                source = args[0]
                dtype = kwargs.get("dtype") or source.dtype
                with _disable_current_modes():  # a real tensor on the host
                    return torch.zeros(source.shape, dtype=dtype)  # the device's values are not known here
        if target is not None and target.type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cuda", self.index(target))}
        return func(*args, **kwargs)  # to the FakeTensorMode beneath

    @staticmethod
    def crossing(func, args, kwargs, target):
        """("host" or "device", non_blocking) for a copy between the host and a GPU; None for anything else."""
        if func is aten._to_copy.default and target is not None:
            source = args[0].device.type
            if source != target.type and "cuda" in (source, target.type):
                return ("host" if target.type == "cpu" else "device"), kwargs.get("non_blocking", False)
        if func is aten.copy_.default:
            destination, source = args[0].device.type, args[1].device.type
            if destination != source:
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                return ("host" if destination == "cpu" else "device"), non_blocking
        return None


REAL_EMPTY = torch.empty


def unpinned_empty(*args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
    """torch.empty, its pinned host memory plain (pinning needs a GPU's driver): in the threads that make batches
    ahead too, where the dispatch mode above, which is the thread's own, does not reach."""
    return REAL_EMPTY(*args, **kwargs)


@contextlib.contextmanager
def substituted(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@torch.no_grad()
def backward(root: torch.Tensor, gradient: torch.Tensor | None = None, *args, **kwargs) -> None:
    """root.backward(gradient) without torch's autograd engine, which starts the streams of the GPUs a graph uses
    and so needs their driver. The graph's nodes are called in an order where each comes after every node that
    feeds it a gradient, and each gradient is fitted to the input it is for (summed to its shape, cast to its
    dtype), as the engine does; a gradient on another device than its input fails, as it does there."""
    gradient = torch.ones_like(root) if gradient is None else gradient
    waiting = collections.Counter()  # node: the gradients it still waits for
    stack, seen = [root.grad_fn], {root.grad_fn}
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None:
                waiting[child] += 1
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    inputs = {root.grad_fn: [gradient]}
    ready = [root.grad_fn]
    while ready:
        node = ready.pop()
        grads = inputs.pop(node)
        outputs = node(*grads) if callable(node) else node.apply(*grads)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for (child, slot), grad in zip(node.next_functions, outputs, strict=False):
            if child is None:
                continue
            received = inputs.setdefault(child, [None] * len(child._input_metadata))
            if grad is not None:
                grad = fitted(grad, child._input_metadata[slot])
                received[slot] = grad if received[slot] is None else received[slot] + grad
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)


def fitted(grad: torch.Tensor, expected) -> torch.Tensor:
    """`grad` as the input it flows to expects it (the autograd engine's validate_outputs)."""
    if grad.device != expected.device:
        raise RuntimeError(f"invalid gradient: on {grad.device}, its input is on {expected.device}")
    if tuple(grad.shape) != tuple(expected.shape):
        grad = grad.sum_to_size(expected.shape)
    return grad if grad.dtype == expected.dtype else grad.to(expected.dtype)
