"""How the model computes: the precision (float32, or bfloat16/float16 autocast) and the memory layout (NCHW or
channels_last), and the rule that chooses them for the machine and image size in hand."""

from dataclasses import dataclass

import torch

from plumbing.machine import cpu_bfloat16


@dataclass(frozen=True)
class Compute:
    """How the model computes: the autocast precision (None: float32 throughout) and the memory layout.

    Under autocast, convolutions and matrix products run in `amp_dtype` (bfloat16 or float16) while weights,
    gradients and the optimizer stay float32. channels_last stores images as NHWC, the layout the CPU's oneDNN
    and the GPU's tensor cores convolve fastest in; the model's weights must be converted too
    (model.initial_model does).
    """

    amp_dtype: torch.dtype | None = None
    channels_last: bool = False

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
        # non_blocking only pays on CUDA, from the pinned memory the loader fills there.
        device = torch.device(device)
        return images.to(device, non_blocking=device.type == "cuda", memory_format=self.memory_format)


# On the CPU, channels_last pays only where the last stage's feature maps are 3x3 or larger: images of 96 px and
# up, at ResNet's stride of 32. At 2x2 and below, torch converts each convolution's weights between the two
# layouts at every step (measured on an AVX2 CPU: +17 ms per 512x512 3x3 convolution at 2x2, +62 %; at 32 px the
# whole model trains 21 % slower in channels_last). From 96 px it is as fast or faster: +5-10 % at 224 px on AVX2,
# +17 % (float32) and +26 % (bfloat16) on AMX.
CHANNELS_LAST_MIN_SIZE = 96


def choose_compute(amp: str, channels_last: bool | None, device: torch.device, img_size: int) -> tuple[Compute, str]:
    """The precision and memory layout to train in, and a line saying which and why.

    amp "auto": bfloat16 where the device computes it natively (GPUs from Ampere on; CPUs with AMX or
    AVX512-BF16, unless ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA cap torch below them), float32 elsewhere.
    channels_last None: on GPUs, and on the CPU from CHANNELS_LAST_MIN_SIZE px up. On a Mac's GPU (mps), neither
    has been measured here, so auto is float32 in NCHW there. Given values win.
    """
    if amp == "auto":
        if device.type == "cuda":
            native = torch.cuda.get_device_capability(device) >= (8, 0)  # Ampere and later compute bf16 natively
            why = "this GPU computes bfloat16 natively" if native else "this GPU has no native bfloat16"
        elif device.type == "mps":
            native, why = False, "autocast on mps is not measured here"
        else:
            native, why = cpu_bfloat16()
        amp, amp_reason = ("bf16" if native else "off"), f"--amp auto: {why}"
    else:
        amp_reason = f"--amp {amp}"
    if channels_last is None:
        if device.type == "mps":
            channels_last, layout_reason = False, "auto: channels_last on mps is not measured here"
        elif device.type == "cuda":
            channels_last, layout_reason = True, "auto: GPUs convolve fastest in it"
        else:
            channels_last = img_size >= CHANNELS_LAST_MIN_SIZE
            layout_reason = (
                f"auto: {img_size} px {'>=' if channels_last else '<'} {CHANNELS_LAST_MIN_SIZE} px on the CPU"
            )
    else:
        layout_reason = "--channels-last" if channels_last else "--no-channels-last"
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    name = {"off": "float32", "bf16": "bfloat16 autocast", "fp16": "float16 autocast with gradient scaling"}[amp]
    layout = "channels_last" if channels_last else "NCHW"
    return Compute(dtype, channels_last), f"Precision: {name} ({amp_reason}); memory layout {layout} ({layout_reason})"
