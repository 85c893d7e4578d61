"""A benchmark row's "% of peak": the compute peak per precision, a training step's FLOPs per image, and the row."""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from autotune.choose import PRECISION_NAMES
from autotune.timing import synchronize
from multi_train_utils.train_eval_utils import Choice
from network.architectures import create_model


def measure_peaks(choices: list[Choice], device: torch.device) -> dict:
    """FLOP/s of float32 and of every other precision of `choices`, by name ("float32", "bfloat16", ...)."""
    dtypes = {torch.float32} | {choice.amp_dtype for choice in choices if choice.amp_dtype is not None}
    return {peak_name(dtype): compute_peak(dtype, device) for dtype in sorted(dtypes, key=str, reverse=True)}


def peak_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def compute_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the fastest dense work in `dtype` on `device`: matrix products and, on the CPU, convolutions
    (docs/performance.md, "The benchmark", says why; and why float32 is timed in TensorFloat-32 on a GPU)."""
    on_gpu = device.type == "cuda"
    size, per_round = (8192, 10) if on_gpu else (2048, 1)
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    product = torch.empty_like(a)
    products = lambda: [torch.matmul(a, b, out=product) for _ in range(per_round)]  # noqa: E731
    works = [(2 * size**3 * per_round, products)]  # (its FLOPs, the work)
    if not on_gpu:
        images, kernels = torch.randn(16, 512, 28, 28).to(dtype), torch.randn(512, 512, 3, 3).to(dtype)
        works.append((2 * 16 * 512 * 512 * 9 * 28 * 28, lambda: torch.nn.functional.conv2d(images, kernels, padding=1)))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if on_gpu and dtype == torch.float32 else precision)
    try:
        return max(flops / min(seconds(work, device) for _ in range(6)) for flops, work in works)
    finally:
        torch.set_float32_matmul_precision(precision)


def seconds(work, device: torch.device) -> float:
    """A call of work(), from an idle device to an idle device."""
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - start


def training_flops_per_image(model_name: str, img_size: int) -> float:
    """FLOPs of one training step (forward and backward) of the model, per image."""
    model, batch = create_model(5, model_name), 2
    images, labels = torch.randn(batch, 3, img_size, img_size), torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() / batch


def row(name: str, kind: str, processes: int, precision: str, measured: dict, peak=None, flops=None) -> dict:
    """One row of benchmark.json; `peak` and `flops` are None for a row that does not train."""
    peak_fraction = measured["img_per_sec"] * flops / peak if flops is not None else None
    return {"name": name, "kind": kind, "processes": processes, "precision": precision, **measured,
            "peak_fraction": peak_fraction}  # fmt: skip


def trained_row(name: str, kind: str, processes: int, choice: Choice, measured: dict, peaks: dict, flops: float):
    return row(name, kind, processes, described(choice), measured, peaks[peak_name(choice.amp_dtype)], flops)


def described(choice: Choice) -> str:
    """A row's precision and layout: "bfloat16 autocast, channels_last"."""
    return f"{PRECISION_NAMES[choice.amp]}, {'channels_last' if choice.channels_last else 'NCHW'}"


def worker_phrase(count: int) -> str:
    return f"{count} worker{'s' * (count != 1)}"
