"""How the model computes: the precision (float32, or bfloat16/float16 autocast) and the memory layout (NCHW or
channels_last), as the flags name them (which of them auto times on the device in hand: run/autotune.py)."""

from dataclasses import dataclass

import torch

from dataset.transforms import normalise


@dataclass(frozen=True)
class Compute:
    """How the model computes: the autocast precision (None: float32 throughout), the memory layout, and how many
    images a forward and backward pass takes at most (`micro_batch`; None: a step's whole batch at once).

    Under autocast, convolutions and matrix products run in `amp_dtype` (bfloat16 or float16) while weights,
    gradients and the optimizer stay float32. channels_last stores images as NHWC, the layout the CPU's oneDNN
    and the GPU's tensor cores convolve fastest in; the model's weights must be converted too
    (model.initial_model does). A batch larger than `micro_batch` is taken in micro-batches of that many images,
    their gradients summed (train_eval_utils.train_one_epoch): the step the same, its memory that of the
    micro-batch (run/autotune.py finds the largest that fits a GPU). `on_device`: each training batch is made on
    the device from images held there (run/batches.py says where it can be), instead of by loader processes.
    """

    amp_dtype: torch.dtype | None = None
    channels_last: bool = False
    micro_batch: int | None = None
    on_device: bool = False  # the training batches made on the device (dataset/on_device.py), not by a loader

    @property
    def memory_format(self) -> torch.memory_format:
        """For the images of each batch and for the model's weights (`model.to(memory_format=...)`)."""
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """The gradient scaler for train_one_epoch: active for float16 only, a pass-through otherwise."""
        return torch.amp.GradScaler(device.type, enabled=self.amp_dtype == torch.float16)

    def batch_to(self, images: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch of images on `device`, in this memory layout. 8-bit images, as the loaders give them, travel
        as they are (a quarter of float32's bytes) and are normalised there (dataset/transforms.py's normalise)."""
        device = torch.device(device)
        # non_blocking only pays on CUDA, from the pinned memory the loader fills there. The layout is changed on
        # the 8-bit pixels, and normalising keeps it: one float32 copy instead of two.
        return normalise(images.to(device, non_blocking=device.type == "cuda", memory_format=self.memory_format))


# The --amp values and what each computes in.
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_NAMES = {"off": "float32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast with gradient scaling"}


def amp_flag(compute: Compute) -> str:
    """The --amp value that computes as `compute` does ("off", "bf16" or "fp16")."""
    return next(flag for flag, dtype in AMP_DTYPES.items() if dtype == compute.amp_dtype)


def short_name(compute: Compute) -> str:
    """E.g. "bfloat16 channels_last", for the lines that list what was measured."""
    precision = "float32" if compute.amp_dtype is None else str(compute.amp_dtype).removeprefix("torch.")
    return f"{precision} {'channels_last' if compute.channels_last else 'NCHW'}"


def summary(compute: Compute, amp_reason: str, layout_reason: str) -> str:
    """The line a run prints about how it computes, e.g. "Precision: float32 (--amp off); memory layout NCHW
    (--no-channels-last)"."""
    layout = "channels_last" if compute.channels_last else "NCHW"
    return f"Precision: {PRECISION_NAMES[amp_flag(compute)]} ({amp_reason}); memory layout {layout} ({layout_reason})"


def choose_compute(amp: str, channels_last: bool | None, device: torch.device) -> tuple[Compute, str]:
    """How to compute without measuring, and the line saying so: the flags' values where given; what is left to
    auto is float32 and NCHW, the original's (training measures instead: run/autotune.py; this is for
    predicting with a run recorded before it did, and for runs whose flags say everything)."""
    if amp == "auto":
        amp, amp_reason = "off", "--amp auto: not measured"
    else:
        amp_reason = f"--amp {amp}"
    if channels_last is None:
        channels_last, layout_reason = False, "auto: not measured"
    else:
        layout_reason = "--channels-last" if channels_last else "--no-channels-last"
    compute = Compute(AMP_DTYPES[amp], channels_last)
    return compute, summary(compute, amp_reason, layout_reason)
