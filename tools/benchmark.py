"""Measure training speed: the model and the loader alone, then each launch script end to end.

python tools/benchmark.py                       # 224 px, batch 16, generated 320x240 JPEGs
python tools/benchmark.py --data-path flower_photos --img-size 224 --batch-size 32 --nprocs 4
python tools/benchmark.py --rows model-only,auto --batch-size 256   # only these rows (auto always runs)
python tools/benchmark.py --model resnet50 --rows model-only,auto   # another network (default: the scripts')
python tools/benchmark.py --startup-sizes 1000,10000,100000   # start-up alone (tools/startup_benchmark.py)
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python tools/benchmark.py    # an AVX-512 CPU computing as an AVX2 one

Rows, each a fresh process (or group of processes) so that no row inherits another's warm caches or memory, by
their kind (benchmark.json's "kind"; --rows picks kinds, default all):
  model-only     three rows. "model only (the ceiling)": the bare training step (autocast forward, cross-entropy,
                 scaled backward, optimizer step) on one random batch already on the device, with no host
                 synchronisation inside the loop: the ceiling for this precision and layout. "model only,
                 loss.item() each step": the same, the CPU waiting for each step's loss before it queues the
                 next. "model only, float32 NCHW": the ceiling's loop in float32 and NCHW
  compile        "model only, torch.compile": the ceiling's step with the model compiled (torch.compile's defaults),
                 and its compile_seconds: the first step, which compiles, against a step after it
  loop           "train_one_epoch, tensors in memory": the training loop itself, fed one batch of 8-bit images
                 from host memory at every step (normalised on the device, as the loaders' batches are)
  loader         the training loader as the scripts build it (its images decoded once into memory where they fit,
                 as the scripts decide; the row's "decoded" says how), iterated without a model: with 1 worker,
                 and with the workers the scripts use on this device (at least 1); images per second after the
                 first batches, at least --loader-images of them
  peer           the bare training step (as the model-only rows take it) fed as torchvision's reference scripts
                 and timm feed a GPU: an ImageFolder of the data, each image decoded, cropped and flipped with PIL
                 and normalised in a loader worker, as many workers as cores, pinned memory, persistent workers;
                 images per second over the epochs after the first (--epochs), epoch starts included
  profile        a torch.profiler trace of --profile-steps steps of the real loop (train_one_epoch fed by the
                 training loader, both built as train_single_gpu.py builds them, in what auto chose), from the start
                 of its second epoch: profile_trace.json.gz in --output-dir (Perfetto or chrome://tracing opens it),
                 and its summary (tools/profile_steps.py): the top operations, the seconds the GPU sat idle between
                 its kernels, the seconds the loop waited for batches; the row's img/s is the traced steps' (the
                 profiler's own cost included)
  baseline       train_single_gpu.py as the original scripts ran: float32, NCHW, loader workers restarted each epoch
  fixed          train_single_gpu.py in each fixed precision and layout (--fixed: float32 NCHW, the original's;
                 float32 channels_last; bfloat16 in both where the device has its instructions), with the loader
                 workers auto chose
  auto           train_single_gpu.py with this collection's defaults (or --amp / --channels-last): precision,
                 layout and workers left to auto, which measures them in this, its first run (the benchmark keeps
                 its own cache of auto's choices, in --output-dir, so every benchmark measures anew). It runs
                 first, whatever --rows says: the rows without a script use what it chose
  paths          train_single_gpu.py with its batches made where auto did not choose to make them: on the device
                 (--batches device) or by the loader (--batches loader, its workers left to auto); the auto row is
                 the other path (a path that cannot run here, images too large for the device say, is left out
                 with a line saying why)
  torchrun, spawn   the two DDP launch scripts with --nprocs processes, auto as in the auto row (--skip-ddp: none)
  demo           train_single_gpu.py --demo, its first run (--skip-demo: none): the demo's time and accuracy, and
                 what auto's measuring cost at the demo's size
  predict        predict.py on every image of the data with auto's weights, precision and layout, into a results
                 file: in one process, and with --nprocs under torchrun; images per second as predict.py reports
                 them, beside the training step's model-only ceiling (the first model-only row, if measured)
The rows without a loader time --steps steps after 3 untimed ones, the device synchronised before the clock starts
and before it stops. End-to-end figures come from the runs' own metrics.jsonl: training images per second and
epoch wall time (training and validation) averaged over the epochs after the first, which pays one-off start-up
costs.

They are measured in this order: auto, then the others in the order above. benchmark.json is written after
auto's row and again after every row (atomically: a new file renamed over the old), its rows in the order above
and its "complete" false until the last, and each row's line of the table is printed as it is measured: a
benchmark stopped midway leaves every row it finished. The whole table and the targets are printed at the end;
a target whose rows were not measured says so.

The machine is stated with the figures: the processor, the instruction set torch computes with, the cores, and
the measured peak of large matrix products and convolutions in each precision (compute_peak); each row's "% of
peak" is its training FLOPs per second (torch's FlopCounterMode over one training step, times images per second)
against the peak of the precision it computed in (none for the loader rows, which do not train). Writes
benchmark.json, benchmark.png (plot_results.plot_benchmark, at the end) and each run's folder and log to
--output-dir.
"""

import argparse
import datetime
import functools
import itertools
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty

import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project's modules, for `python tools/benchmark.py` from anywhere

from dataset.demo import make_demo_data  # noqa: E402
from dataset.folders import read_split_data  # noqa: E402
from dataset.transforms import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from machine import describe_cpu, use_cores  # noqa: E402
from model import create_model, data_parallel_over_gpus, initial_model  # noqa: E402
from multi_train_utils.distributed_utils import Process, resolve_device, shuffled_batches  # noqa: E402
from multi_train_utils.train_eval_utils import Training, train_one_epoch  # noqa: E402
from my_dataset import EpochsAhead, TrainingBatches, ValidationBatches, datasets, loader_options  # noqa: E402
from plot_results import plot_benchmark  # noqa: E402
from recipe.config import DEMO_DEFAULTS, SINGLE, Config, model_name, parse_config  # noqa: E402
from recipe.loss import build_objective  # noqa: E402
from recipe.optimizer import build_optimizer, model_ema  # noqa: E402
from recipe.precision import AMP_DTYPES, PRECISION_NAMES, Compute, amp_flag, choose_compute, short_name  # noqa: E402
from run.autotune import CACHE_ENV, amp_candidates, cache_file, read_entries, synchronize, training_step  # noqa: E402
from run.metrics import peak_memory  # noqa: E402
from run.plan import Plan  # noqa: E402
from tools.profile_steps import printed, traced  # noqa: E402
from tools.startup_benchmark import image_counts, startup_benchmark  # noqa: E402
from utils import Parser, UserError, entry_point, number, write_json  # noqa: E402

FLOWER_PHOTOS_SIZE = (320, 240)  # about the size of the images in flower_photos
# The fixed configurations auto is compared with: --amp, channels_last
# The kinds of row, in the order of the table (see the docstring)
KINDS = ("model-only", "compile", "loop", "loader", "peer", "profile", "baseline", "fixed", "auto", "paths", "torchrun",
         "spawn", "demo", "predict")  # fmt: skip
TABLE_HEADER = (
    "| configuration | processes | precision, layout | img/s | × baseline | % of peak | epoch (s) "
    "| first epoch (s) | peak RSS / process (MiB) |\n|---|---:|---|---:|---:|---:|---:|---:|---:|"
)
FIXED = {"float32-nchw": ("off", False), "float32-channels_last": ("off", True), "bf16-nchw": ("bf16", False),
         "bf16-channels_last": ("bf16", True)}  # fmt: skip


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--img-size", type=number(int, 1), default=Config.default("img_size"), help="training crop size")
    p.add_argument(
        "--model",
        type=model_name,
        default=Config.default("model"),
        help="the network every row trains, as the scripts' --model (torchvision's name, or timm/NAME)",
    )
    batch = Config.default("batch_size")
    p.add_argument("--batch-size", type=number(int, 1), default=batch, help="images per step in each process")
    p.add_argument(
        "--data-path",
        type=Path,
        help="a class-per-folder dataset (default: generated flower_photos-sized JPEGs in data/)",
    )
    p.add_argument(
        "--images-per-class", type=number(int, 10), default=60, help="size of the generated dataset (5 classes)"
    )
    p.add_argument("--epochs", type=number(int, 2), default=3, help="epochs per run; the first is not averaged")
    p.add_argument("--steps", type=number(int, 1), default=20, help="timed steps of the rows without a loader")
    p.add_argument(
        "--loader-images", type=number(int, 1), default=512, help="timed images of the loader rows (at least)"
    )
    p.add_argument(
        "--profile-steps", type=number(int, 1), default=10, help="steps the profile row traces (from its second epoch)"
    )
    p.add_argument("--nprocs", type=number(int, 1), help="DDP processes (default: GPUs visible, or 2 on the CPU)")
    add_row_choices(p)
    return p.parse_args(argv)


def add_row_choices(p: Parser) -> None:
    """The flags that say which rows are measured, how they compute, and where their results go."""
    p.add_argument(
        "--amp",
        choices=["auto", "off", "bf16", "fp16"],
        default="auto",
        help="precision of the auto row and the rows that compute as it does (auto: measured, as the scripts do)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="NHWC layout of the same rows (default: auto, measured)",
    )
    p.add_argument(
        "--fixed",
        type=fixed_list,
        help=f"fixed configurations run end to end beside auto, comma-separated, of {', '.join(FIXED)} "
        "(default: the float32 ones, and the bf16 ones where the device has bfloat16 instructions); none: no such row",
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--output-dir", type=Path, default=Path("benchmark"), help="where results and runs go")
    p.add_argument(
        "--rows",
        type=kind_list,
        default="all",
        help=f"the kinds of row to measure, comma-separated, of {', '.join(KINDS)} (auto always runs: the rows "
        "without a script compute as it chose)",
    )
    p.add_argument("--skip-ddp", action="store_true", help="leave out the torchrun and spawn rows")
    p.add_argument("--skip-demo", action="store_true", help="leave out the demo's run (a minute or two on a CPU)")
    p.add_argument(
        "--startup-sizes",
        type=image_counts,
        help="measure start-up alone instead: seconds to the first training step, cold and warm, on generated "
        "folders of these many images (e.g. 1000,10000,100000); see tools/startup_benchmark.py",
    )


def kind_list(text: str) -> list[str]:
    names = list(KINDS) if text == "all" else text.split(",")
    unknown = [name for name in names if name not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(KINDS)}")
    return names


def fixed_list(text: str) -> list[str]:
    names = [] if text == "none" else text.split(",")
    unknown = [name for name in names if name not in FIXED]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(FIXED)}")
    return names


def _in_memory(queue, mode, model_name, img_size, batch_size, amp, channels_last, device, steps):
    """In a fresh process: `steps` timed training steps on one random batch held in memory, after three untimed
    ones (allocations, kernel choices). `mode` "bare": the step alone, the batch on the device once; "item": the
    same with loss.item() after each step; "loop": train_one_epoch, which moves the batch to the device and
    reads the loss at every step, as training does; "compiled": "bare" with the model compiled, the first
    untimed step (the compilation) timed on its own."""
    sys.stdout = open(os.devnull, "w")  # train_one_epoch's progress bar
    device = resolve_device(device)
    compute, _ = choose_compute(amp, channels_last, device)
    model = initial_model(model_name, 5, device, compute.memory_format)  # as the scripts build it, in one process
    trained = torch.compile(model) if mode == "compiled" else model
    # The training scripts' optimizer at their default settings (the step's cost does not depend on them).
    optimizer, _ = build_optimizer(model, parse_config(SINGLE, "", []), batches_per_epoch=1)
    scaler = compute.grad_scaler(device)
    generator = torch.Generator().manual_seed(0)
    # 8-bit images, as the loader gives them: batch_to normalises them on the device
    images = torch.randint(0, 256, (batch_size, 3, img_size, img_size), generator=generator, dtype=torch.uint8)
    batch = (images, torch.randint(0, 5, (batch_size,)))
    if mode == "loop":
        run = functools.partial(loop_steps, trained, optimizer, scaler, compute, device, batch)
    else:
        on_device = compute.batch_to(batch[0], device), batch[1].to(device)
        run = functools.partial(bare_steps, trained, optimizer, scaler, compute, on_device, host_sync=mode == "item")
    first = time.perf_counter()
    run(1)
    synchronize(device)
    first = time.perf_counter() - first
    run(2)
    synchronize(device)
    start = time.perf_counter()
    run(steps)
    synchronize(device)  # the clock stops when the device has finished the queued steps, not when they are queued
    seconds = time.perf_counter() - start
    measured = {"img_per_sec": steps * batch_size / seconds, "host_sync_each_step": mode in ("item", "loop")}
    if mode == "compiled":  # the compilation: what the first step took more than a compiled one
        measured["compile_seconds"] = first - seconds / steps
    queue.put(measured | peak_memory(device))


def bare_steps(model, optimizer, scaler, compute, batch, steps: int, host_sync: bool) -> None:
    """`steps` training steps on `batch` (images and labels on the device): forward under autocast,
    cross-entropy, the scaled backward pass and the optimizer's step. With `host_sync`, loss.item() after each
    step, as a loop that logs or checks every step's loss does: the CPU waits for the device, so it cannot queue
    the next step's work while the device computes this one."""
    model.train()
    for _ in range(steps):
        loss = training_step(model, optimizer, scaler, compute, *batch)  # as auto times it
        if host_sync:
            loss.item()


def loop_steps(model, optimizer, scaler, compute, device, batch, steps: int) -> None:
    """`steps` training steps through train_one_epoch, `batch` (in host memory) standing in for the loader."""
    train_one_epoch(Training(model, optimizer, compute=compute, scaler=scaler), [batch] * steps, device, 0)


def _loader(queue, plan, img_size, batch_size, workers, images, start_method, device):
    """In a fresh process: images per second of the training loader as train_single_gpu.py builds it (at its
    default settings, on `device`), iterated without a model. Its workers start as they do in the script: by
    `start_method`, the platform's default (this process was started by the forkserver, and would otherwise start
    them that way too).

    The first max(2, workers) batches are not timed: the workers start and fill their queues. Then at least
    `images` images, in whole rounds of `workers` batches (the workers deliver batches in turn, each its own),
    over as many epochs as that takes."""
    multiprocessing.set_start_method(start_method, force=True)
    config = parse_config(SINGLE, "", ["--img-size", str(img_size), "--batch-size", str(batch_size)])
    train_loader, _, decoded = training_loader(plan, config, workers, device, Compute())  # the loader's batches
    batches = batches_over_epochs(train_loader)
    for _ in range(max(2, workers)):
        next(batches)
    rounds = math.ceil(math.ceil(images / batch_size) / workers)
    start = time.perf_counter()
    loaded = sum(len(next(batches)[1]) for _ in range(rounds * workers))
    seconds = time.perf_counter() - start
    queue.put(
        {"img_per_sec": loaded / seconds, "workers": workers, "decoded": decoded, **peak_memory(torch.device("cpu"))}
    )


def training_loader(plan: Plan, config, workers: int, device: torch.device, compute: Compute) -> tuple:
    """The training and validation loaders as train_single_gpu.py builds them, for `config` (a Config) and
    `workers` loader workers on `device` computing as `compute` says (batches made on the device where
    compute.on_device), and the line saying whether the images were decoded once into memory."""
    process = Process(device=device)
    # statement for statement: train_single_gpu.py
    train_set, val_set, decoded = datasets(plan.split, config, process)
    # end of train_single_gpu.py
    # statement for statement: train_single_gpu.py
    loading = loader_options(workers, config, device)
    batches = shuffled_batches(train_set, config.batch_size, config.seed)
    val_sampler = range(len(val_set))
    if compute.on_device:
        train_loader = TrainingBatches(train_set, batches, device, compute.memory_format)
        val_loader = ValidationBatches(val_set, val_sampler, config.batch_size, device)
    else:
        train_loader = EpochsAhead(DataLoader(train_set, batch_sampler=batches, **loading), config.epochs)
        val_loader = EpochsAhead(DataLoader(val_set, batch_size=config.batch_size, sampler=val_sampler, **loading))
    # end of train_single_gpu.py
    return train_loader, val_loader, decoded


def _profile(queue, plan, flags, compute, workers, steps, start_method, device, folder):
    """In a fresh process: the training loop as train_single_gpu.py builds it (its data, loader, model and recipe
    at their default settings, in the precision, layout and loader workers auto chose, given here), its first
    epoch untraced, then `steps` steps traced by torch.profiler (tools/profile_steps.py): the trace in `folder`,
    the summary and the traced steps' images per second on the queue."""
    multiprocessing.set_start_method(start_method, force=True)
    sys.stdout = open(os.devnull, "w")  # the progress bars
    device = resolve_device(device)
    config = parse_config(SINGLE, "", flags)
    use_cores(device, 1, config.batch_size, workers)  # the compute threads tune() leaves beside the workers
    train_loader, _, decoded = training_loader(plan, config, workers, device, compute)
    # statement for statement: train_single_gpu.py
    model = initial_model(
        config.model, len(plan.split.classes), device, compute.memory_format,
        seed=config.seed, weights=plan.weights, freeze=config.freeze_layers,
        grad_checkpointing=config.grad_checkpointing,
    )  # fmt: skip
    trained = data_parallel_over_gpus(model, device) if config.data_parallel else model
    trained = torch.compile(trained) if config.compile else trained
    optimizer, scheduler = build_optimizer(trained, config, len(train_loader))
    training = Training(
        trained, optimizer, scheduler, compute, compute.grad_scaler(device),
        objective=build_objective(config, plan.split, device), accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm, ema=model_ema(model, config.ema_decay) if config.model_ema else None,
    )  # fmt: skip
    # end of train_single_gpu.py
    found = traced(
        lambda loader: train_one_epoch(training, loader, device, 1),
        batches_over_epochs(train_loader), len(train_loader), steps, device, folder,
    )  # fmt: skip
    found["img_per_sec"] = found["traced_steps"] * config.batch_size / found["traced_seconds"]
    queue.put(found | {"workers": workers, "decoded": decoded} | peak_memory(device))


def batches_over_epochs(loader):
    """The loader's batches, epoch after epoch without end, each epoch with its own shuffle as in training."""
    for epoch in itertools.count():
        loader.batch_sampler.set_epoch(epoch)
        yield from loader


def in_fresh_process(name: str, target, *args) -> dict:
    """What `target(queue, *args)` puts on the queue, run in a new process: no warm caches, no memory or threads
    left over from another row. Each is forked from multiprocessing's forkserver, a process that has imported this
    module (torch and torchvision with it) and run nothing, so a row does not spend seconds importing them anew."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # Preloaded by its name: "__main__" is not (Python 3.11's forkserver drops the script's path from what it
        # is given), and each row then imported torch anew. Takes effect when the server starts, with the first row.
        context.set_forkserver_preload(["tools.benchmark"])
    else:  # Windows has no fork server: each row a new interpreter
        context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(queue, *args))
    process.start()
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except Empty:
            if not process.is_alive():
                raise UserError(f"{name}: its process failed (exit status {process.exitcode}); see above") from None
    process.join()
    return result


def compute_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the fastest dense work in `dtype` on `device` (on the CPU, on all of this process's cores): the
    machine's practical peak in that precision, the best of 6 timed rounds of each kind of work.

    The work is square matrix products and, on the CPU, 3x3 convolutions of 512 channels, a ResNet's own kind of
    work. torch's CPU matrix products are MKL's, and on AMD CPUs MKL's float32 reaches half of what oneDNN's
    convolutions do: 211 against 428 GFLOP/s on a 2-core Zen 5 (2026-11-28), so a matrix product alone put
    float32 rows above 100 % of their "peak". On a GPU, cuBLAS's products are as fast as anything there.

    A round must last long beside launching its work and waiting for its end. On the CPU one product of 2048 x 2048
    matrices (17 GFLOP), or one convolution of 16 images of 28 x 28 (30 GFLOP), does. A fast GPU computes that
    product in about the time it takes to launch it and wait for it, so there a round is 10 products of 8192 x 8192
    matrices (1.1 TFLOP each), queued back to back, with one synchronisation at the end.

    float32 is timed as training computes it. On a GPU, cuDNN computes float32 convolutions, nearly all of a ResNet's
    FLOPs, in TensorFloat-32 (torch.backends.cudnn.allow_tf32, True by default, which nothing here changes); torch
    computes float32 matrix products in full float32 unless told otherwise. So on a GPU the float32 peak is the TF32
    one: the products are timed under torch.set_float32_matmul_precision("high"), and the setting is put back after.
    On the CPU, float32 is float32."""
    on_gpu = device.type == "cuda"
    size, per_round = (8192, 10) if on_gpu else (2048, 1)
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    product = torch.empty_like(a)
    products = lambda: [torch.matmul(a, b, out=product) for _ in range(per_round)]  # noqa: E731
    works = [(2 * size**3 * per_round, products)]  # (its FLOPs, the work)
    if not on_gpu:
        images, kernels = torch.randn(16, 512, 28, 28).to(dtype), torch.randn(512, 512, 3, 3).to(dtype)
        works.append((2 * 16 * 512 * 512 * 9 * 28 * 28, lambda: torch.nn.functional.conv2d(images, kernels, padding=1)))
    tf32 = on_gpu and dtype == torch.float32
    precision = torch.get_float32_matmul_precision()
    if tf32:
        torch.set_float32_matmul_precision("high")
    try:
        return max(flops / best_of_rounds(work, device) for flops, work in works)
    finally:
        if tf32:
            torch.set_float32_matmul_precision(precision)


def best_of_rounds(work, device: torch.device, rounds: int = 6) -> float:
    """The shortest of `rounds` timed calls of work(), in seconds, each from an idle device to an idle device."""
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def training_flops_per_image(model_name: str, img_size: int) -> float:
    """Floating-point operations of one training step (forward and backward) of the model, per image."""
    model, batch = create_model(5, model_name), 2
    images, labels = torch.randn(batch, 3, img_size, img_size), torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    return counter.get_total_flops() / batch


def row(name: str, kind: str, processes: int, precision: str, measured: dict, peak=None, flops=None) -> dict:
    """One line of the table; `peak` is the FLOP/s of the precision the row computed in, `flops` a training
    step's FLOPs per image (both None for a row that does not train: its peak_fraction is None)."""
    peak_fraction = measured["img_per_sec"] * flops / peak if flops is not None else None
    return {"name": name, "kind": kind, "processes": processes, "precision": precision, **measured,
            "peak_fraction": peak_fraction}  # fmt: skip


def against_targets(rows: list[dict], native_bf16: bool) -> list[str]:
    """The project's speed targets, each with its ratio measured in this run and whether it is met ("not measured"
    where a row it needs was not), and what the per-step loss.item() costs (no target)."""
    first = {}
    for row in rows:
        first.setdefault(row["kind"], row)  # of the model-only rows, the first: the ceiling
    ceiling, baseline, single = first.get("model-only"), first.get("baseline"), first.get("auto")
    loader = (rows_of(rows, "loader") or [None])[-1]  # with the training scripts' workers
    over_baseline = 3.5 if native_bf16 else 1.15  # float32 alone is capped by the machine's float32 peak
    kind = "bfloat16 native" if native_bf16 else "float32 only"
    if loader:
        feeds = f"loader with {worker_phrase(loader['workers'])} feeds {loader['img_per_sec']:.1f} img/s"
    else:
        feeds = "loader with the training scripts' workers"
    lines = [
        ratio_target("single process >= 90 % of the model-only ceiling", single, ceiling, 0.9, "{:.0%}"),
        ratio_target(f"single process >= {over_baseline}x the original's setup ({kind})", single, baseline,
                     over_baseline, "{:.2f}x"),
        ratio_target(f"{feeds}, >= the model-only ceiling", loader, ceiling, 1.0, "{:.2f}x"),
    ]  # fmt: skip
    for kind in ("torchrun", "spawn"):
        processes = f", {first[kind]['processes']} processes" if kind in first else ""
        lines.append(ratio_target(f"{kind}{processes} >= 0.8x one process", first.get(kind), single, 0.8, "{:.2f}x"))
    if "spawn" in first and "torchrun" in first:
        ratio = first["spawn"]["epoch_seconds"] / first["torchrun"]["epoch_seconds"]
        lines.append(
            f"spawn's epoch takes {ratio:.0%} of torchrun's ({'met' if ratio <= 1.1 else 'NOT met'}: <= 110 %)"
        )
    else:
        lines.append("spawn's epoch within 110 % of torchrun's: not measured")
    synced = next((row for row in rows_of(rows, "model-only") if row["host_sync_each_step"]), None)
    if synced and ceiling:
        lines.append(f"loss.item() each step costs {1 - synced['img_per_sec'] / ceiling['img_per_sec']:.0%} of the "
                     "ceiling's speed (no target)")  # fmt: skip
    else:
        lines.append("loss.item() each step: not measured")
    return lines


def ratio_target(what: str, row: dict | None, against: dict | None, goal: float, form: str) -> str:
    """`what`: row's images per second over against's, and whether that reaches `goal`; "not measured" where
    either row is missing."""
    if row is None or against is None:
        return f"{what}: not measured"
    value = row["img_per_sec"] / against["img_per_sec"]
    return f"{what}: {form.format(value)} ({'met' if value >= goal else 'NOT met'})"


def auto_targets(rows: list[dict]) -> list[str]:
    """The targets of auto's measuring, with the figures of this run: its end-to-end speed against the best fixed
    configuration and against the original's (float32 NCHW), what its measuring cost, the demo's time and
    accuracy; "not measured" where a row they need was not."""
    auto, fixed, lines = (rows_of(rows, "auto") or [None])[0], rows_of(rows, "fixed"), []
    verdict = lambda met: "met" if met else "NOT met"  # noqa: E731
    best = max(fixed, key=lambda row: row["img_per_sec"]) if fixed else None
    original = next((row for row in fixed if row["precision"] == "float32, NCHW"), None)
    best_named = f"the best fixed configuration ({best['precision']})" if best else "the best fixed configuration"
    lines += [
        ratio_target(f"auto (at least 95 %) against {best_named}", auto, best, 0.95, "{:.0%}"),
        ratio_target("auto against the original's configuration (float32, NCHW)", auto, original, 1.0, "{:.2f}x"),
    ]
    if auto and auto.get("measure_seconds") is not None:
        lines.append(f"auto's measuring took {auto['measure_seconds']:.1f} s of its first run's "
                     f"{auto['run_seconds']:.0f} s (no target)")  # fmt: skip
    for demo in rows_of(rows, "demo"):
        share = (demo["measure_seconds"] or 0) / demo["run_seconds"]
        lines += [
            f"the demo's first run measured for {demo['measure_seconds'] or 0:.1f} s, {share:.1%} of its "
            f"{demo['run_seconds']:.0f} s ({verdict(share <= 0.1)}: <= 10 %)",
            f"the demo took {demo['run_seconds']:.0f} s ({verdict(demo['run_seconds'] <= 120)}: <= 120 s) and "
            f"reached validation accuracy {demo['val_acc']:.3f} ({verdict(demo['val_acc'] >= 0.8)}: >= 0.80)",
        ]
    if not rows_of(rows, "demo"):
        lines.append("the demo's time, accuracy and measuring: not measured")
    return lines


def rows_of(rows: list[dict], kind: str) -> list[dict]:
    return [row for row in rows if row["kind"] == kind]


def worker_phrase(count: int) -> str:
    return f"{count} worker{'s' * (count != 1)}"


def run_script(args, name: str, script: list, flags: list, demo: bool = False) -> dict:
    """Train with a script (`script`: what follows `python`) on the benchmark's data and settings, or (`demo`) as
    --demo does; speed and memory from the metrics.jsonl it writes."""
    out = args.output_dir / "runs" / name
    command = [sys.executable, *script, "--output-dir", str(out), "--device", args.device, *flags]
    if demo:
        command.append("--demo")
    else:
        command += [*settings_flags(args), "--data-path", str(args.data_path), "--epochs", str(args.epochs)]
    log = args.output_dir / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise UserError(f"{name} failed (exit status {result.returncode}); see {log}")
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = epochs[1:]
    return {
        "img_per_sec": sum(m["train_images_per_sec"] for m in steady) / len(steady),
        "epoch_seconds": sum(m["epoch_seconds"] for m in steady) / len(steady),
        "first_epoch_seconds": epochs[0]["epoch_seconds"],
        "run_seconds": wall,
        "val_acc": epochs[-1]["val_acc"],
        "peak_rss_mib": max((m["peak_rss_mib"] for m in epochs if "peak_rss_mib" in m), default=None),
        **({"peak_gpu_mib": max(m["peak_gpu_mib"] for m in epochs)} if "peak_gpu_mib" in epochs[0] else {}),
    }


def settings_flags(args) -> list[str]:
    """The scripts' flags for the benchmark's model, crop size and batch size."""
    return ["--model", args.model, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size)]


def training_plan(data_path: Path, batch_size: int, output_dir: Path) -> Plan:
    """The rows' plan: the training scripts' split of the data at their default --val-rate and --seed, unreadable
    images left out, no weights to start from; UserError if it holds less than one batch of training images."""
    split = read_split_data(data_path, verify_images=True)
    if len(split.train_images) < batch_size:
        raise UserError(f"{data_path}: {len(split.train_images)} training images, fewer than a batch of {batch_size}")
    return Plan(data_path, split, output_dir)


def describe_machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{describe_cpu()}; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{describe_cpu()}; no GPU used"


def markdown_table(rows: list[dict]) -> str:
    baseline = next((row for row in rows if row["kind"] == "baseline"), None)
    return "\n".join([TABLE_HEADER, *(table_line(row, baseline) for row in rows)])


def table_line(row: dict, baseline: dict | None) -> str:
    """A row's line of the table; "× baseline" is "–" without a baseline row."""
    epoch = f"{row['epoch_seconds']:.1f}" if row.get("epoch_seconds") else "–"
    first = f"{row['first_epoch_seconds']:.1f}" if row.get("first_epoch_seconds") else "–"
    peak = f"{row['peak_fraction']:.0%}" if row["peak_fraction"] is not None else "–"
    times = f"{row['img_per_sec'] / baseline['img_per_sec']:.2f}" if baseline else "–"
    memory = row.get("peak_rss_mib") or "–"  # none where the OS does not tell (Windows without psutil)
    return (
        f"| {row['name']} | {row['processes']} | {row['precision']} | {row['img_per_sec']:.1f} | {times} | {peak} "
        f"| {epoch} | {first} | {memory} |"
    )


def record(benchmark: dict, new_row: dict, path: Path) -> None:
    """Add a measured row to the benchmark in its place (the table's order of kinds), print its line of the table,
    and write the benchmark to `path` anew, atomically: a benchmark stopped midway leaves every row it finished."""
    rows = benchmark["rows"]
    rows.append(new_row)
    rows.sort(key=lambda row: KINDS.index(row["kind"]))  # a stable sort: rows of a kind stay in measured order
    print(table_line(new_row, next((row for row in rows if row["kind"] == "baseline"), None)), flush=True)
    write_json(path, benchmark)


def measure_peaks(computes: list[Compute], device: torch.device) -> dict:
    """The compute peak of float32 and of every other precision measured, in FLOP/s, by name ("float32",
    "bfloat16", ...)."""
    dtypes = {torch.float32} | {compute.amp_dtype for compute in computes if compute.amp_dtype is not None}
    return {peak_name(dtype): compute_peak(dtype, device) for dtype in sorted(dtypes, key=str, reverse=True)}


def peak_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def described(compute: Compute) -> str:
    """E.g. "bfloat16 autocast, channels_last": a row's precision and layout."""
    return f"{PRECISION_NAMES[amp_flag(compute)]}, {'channels_last' if compute.channels_last else 'NCHW'}"


def in_memory_rows(args, compute: Compute, peaks: dict, flops: float):
    """The rows without a data loader, each yielded as soon as it is measured (those of the kinds in --rows): the
    bare training step (the first: the ceiling), the same with loss.item() each step, the same in float32 NCHW,
    the same compiled, and train_one_epoch's loop over a batch in memory; in what auto chose."""
    cases = [  # name, kind, _in_memory's mode, how it computes
        ("model only (the ceiling)", "model-only", "bare", compute),
        ("model only, loss.item() each step", "model-only", "item", compute),
        ("model only, float32 NCHW", "model-only", "bare", Compute()),
        ("model only, torch.compile", "compile", "compiled", compute),
        ("train_one_epoch, tensors in memory", "loop", "loop", compute),
    ]
    settings = (args.model, args.img_size, args.batch_size)
    for name, kind, mode, case in cases:
        if kind in args.rows:
            measured = in_fresh_process(name, _in_memory, mode, *settings, amp_flag(case), case.channels_last,
                                        args.device, args.steps)  # fmt: skip
            yield row(name, kind, 1, described(case), measured, peaks[peak_name(case.amp_dtype)], flops)


def loader_rows(args, plan: Plan, workers: int):
    """The training loader alone, each row yielded as soon as it is measured (if --rows has them): with one worker
    (what one worker supplies) and with the workers auto chose for the training scripts, at least one (where they
    use none, they load between steps)."""
    if "loader" not in args.rows:
        return
    device = torch.device(args.device)
    if workers == 0:
        theirs = "loader, 1 worker (the training scripts here: none, images loaded between steps)"
    else:
        theirs = f"loader, {worker_phrase(workers)} (as the training scripts)"
    start_method = multiprocessing.get_start_method()  # what a script's loader gets: the platform's default
    for count, name in ((1, "loader, 1 worker"), (max(1, workers), theirs)):
        measure = (plan, args.img_size, args.batch_size, count, args.loader_images, start_method, device)
        measured = in_fresh_process(name, _loader, *measure)
        measured["img_per_sec_per_worker"] = measured["img_per_sec"] / count
        yield row(name, "loader", 1, "–", measured)


def profile_rows(args, plan: Plan, compute: Compute, workers: int):
    """The profile of the real loop (if --rows has it), in what auto chose; its summary printed."""
    if "profile" not in args.rows:
        return
    device = torch.device(args.device)
    measure = (plan, settings_flags(args), compute, workers, args.profile_steps,
               multiprocessing.get_start_method(), args.device, args.output_dir.resolve())  # fmt: skip
    measured = in_fresh_process("profile", _profile, *measure)
    print(printed(measured, device), flush=True)
    feeding = "batches made on the device" if compute.on_device else worker_phrase(workers)
    yield row(f"profile: train_one_epoch, {feeding}", "profile", 1, described(compute), measured)


def auto_run(args) -> tuple[dict, Compute, int]:
    """train_single_gpu.py as a user runs it, precision, layout and workers left to auto (unless --amp or
    --channels-last say): its first run here, so auto measures. Returns the run's figures (with what measuring
    took: measure_seconds), how auto chose to compute, and its loader workers."""
    flags = ["--amp", args.amp] + ([] if args.channels_last is None else [layout_flag(args.channels_last)])
    measured = run_script(args, "auto", [str(ROOT / "train_single_gpu.py")], flags)
    record = json.loads((args.output_dir / "runs" / "auto" / "args.json").read_text())  # what auto chose
    log = (args.output_dir / "logs" / "auto.log").read_text()
    workers = int(re.search(r"(\d+) loader workers per process", log).group(1))
    measured["measure_seconds"] = measuring_seconds(args.img_size, args.batch_size)
    compute = Compute(AMP_DTYPES[record["amp"]], record["channels_last"], on_device=record.get("batches") == "device")
    return measured, compute, workers


def layout_flag(channels_last: bool) -> str:
    return "--channels-last" if channels_last else "--no-channels-last"


def measuring_seconds(img_size: int, batch_size: int) -> float | None:
    """What auto's measuring took in the first single-process run at this size (from the benchmark's own cache of
    auto's choices); None if that run measured nothing (every choice given by a flag)."""
    for entry in read_entries(cache_file()):
        key = entry.get("key", {})
        if (key.get("img_size"), key.get("batch_size"), key.get("processes_here")) == (img_size, batch_size, 1):
            return entry["choice"]["seconds"]
    return None


def fixed_rows(args, names: list[str], workers: int, batches: str, peaks: dict, flops: float):
    """train_single_gpu.py in each fixed precision and layout, fed as auto chose (`batches`: "device" or "loader",
    with its loader workers): what auto's choice of precision and layout is compared with. Each row is yielded as
    soon as it is measured."""
    for name in names:
        amp, channels_last = FIXED[name]
        compute = Compute(AMP_DTYPES[amp], channels_last)
        flags = ["--amp", amp, layout_flag(channels_last), "--workers", str(workers), "--batches", batches]
        measured = run_script(args, f"fixed-{name}", [str(ROOT / "train_single_gpu.py")], flags)
        yield row(f"fixed: {short_name(compute)}", "fixed", 1, described(compute), measured,
                  peaks[peak_name(compute.amp_dtype)], flops)  # fmt: skip


def script_rows(args, compute: Compute, workers: int, nprocs: int, peaks: dict, flops: float):
    """The training scripts end to end but auto's run (measured first), each row yielded as soon as it is measured
    (those of the kinds in --rows): the original's setup, the fixed configurations, the two DDP launch scripts
    (precision and layout left to auto, which measures for them anew: each process has its share of the cores)
    and the demo."""
    single, batches = [str(ROOT / "train_single_gpu.py")], "device" if compute.on_device else "loader"
    if "baseline" in args.rows:
        original_workers = min(os.cpu_count() or 1, args.batch_size, 8)  # the original's num_workers
        baseline = ["--amp", "off", "--no-channels-last", "--no-persistent-workers", "--workers", str(original_workers)]
        baseline += ["--batches", "loader"]
        yield row("baseline: the original's setup", "baseline", 1, "float32, NCHW",
                  run_script(args, "baseline", single, baseline), peaks["float32"], flops)  # fmt: skip
    yield from fixed_rows(args, args.fixed, workers, batches, peaks, flops)
    ours_flags = ["--amp", args.amp] + ([] if args.channels_last is None else [layout_flag(args.channels_last)])
    as_auto = ["--amp", amp_flag(compute), layout_flag(compute.channels_last)]  # auto's precision and layout
    yield from path_rows(args, as_auto, batches, peaks, flops)
    if "torchrun" in args.rows:
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
        launch = [*torchrun, str(ROOT / "train_multi_gpu_using_launch.py")]
        measured = run_script(args, "torchrun", launch, ours_flags)
        precision, peak = as_run(args, "torchrun", peaks)
        yield row(f"torchrun, {nprocs} processes", "torchrun", nprocs, precision, measured, peak, flops)
    if "spawn" in args.rows:
        spawn, flags = [str(ROOT / "train_multi_gpu_using_spawn.py")], [*ours_flags, "--world-size", str(nprocs)]
        measured = run_script(args, "spawn", spawn, flags)
        precision, peak = as_run(args, "spawn", peaks)
        yield row(f"spawn, {nprocs} processes", "spawn", nprocs, precision, measured, peak, flops)
    if "demo" in args.rows:
        demo = run_script(args, "demo", single, [], demo=True)
        demo["measure_seconds"] = measuring_seconds(DEMO_DEFAULTS["img_size"], DEMO_DEFAULTS["batch_size"])
        yield row("train_single_gpu.py --demo, its first run", "demo", 1, as_run(args, "demo", peaks)[0], demo)


def path_rows(args, flags: list[str], chosen: str, peaks: dict, flops: float):
    """train_single_gpu.py with its batches made on the device, or by the loader: the path auto did not choose
    (`chosen`: its row is auto's), if --rows has "paths", in auto's precision and layout (`flags`); a path the
    script refuses here (the images do not fit on the device, say) is left out with the script's line saying
    why."""
    if "paths" not in args.rows:
        return
    for path in {"device", "loader"} - {chosen}:
        try:
            measured = run_script(
                args, f"batches-{path}", [str(ROOT / "train_single_gpu.py")], [*flags, "--batches", path]
            )
        except UserError as failed:
            print(f"  --batches {path}: left out ({failed})", flush=True)
            continue
        precision, peak = as_run(args, f"batches-{path}", peaks)
        yield row(f"train_single_gpu.py, --batches {path}", "paths", 1, precision, measured, peak, flops)


def _peer(queue, data_path, model_name, img_size, batch_size, compute, device, epochs):
    """In a fresh process: the bare training step fed as torchvision's reference scripts and timm feed a GPU (an
    ImageFolder, PIL crops and flips per image, ToTensor and Normalize, in as many loader workers as cores,
    pinned, persistent), `epochs` epochs over every image of `data_path`; images per second over the epochs after
    the first, each epoch timed from its first batch asked for to its last step finished on the device."""
    device = resolve_device(device)
    augment = T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(),
                         T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])  # fmt: skip
    dataset = ImageFolder(data_path, transform=augment)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    loader = DataLoader(dataset, batch_size, shuffle=True, num_workers=cores, pin_memory=device.type == "cuda",
                        persistent_workers=True, drop_last=True)  # fmt: skip
    model = initial_model(model_name, len(dataset.classes), device, compute.memory_format)
    optimizer, _ = build_optimizer(model, parse_config(SINGLE, "", []), batches_per_epoch=len(loader))
    scaler, images_seen, seconds = compute.grad_scaler(device), 0, 0.0
    model.train()
    for epoch in range(epochs):
        start = time.perf_counter()
        for images, labels in loader:
            images = images.to(device, non_blocking=True, memory_format=compute.memory_format)
            training_step(model, optimizer, scaler, compute, images, labels.to(device, non_blocking=True))
            images_seen += len(labels) if epoch else 0
        synchronize(device)
        seconds += time.perf_counter() - start if epoch else 0.0
    queue.put({"img_per_sec": images_seen / seconds, "workers": cores, **peak_memory(device)})


def peer_rows(args, compute: Compute, peaks: dict, flops: float):
    """The peer-style loader's row (if --rows has it), in what auto chose."""
    if "peer" not in args.rows:
        return
    measured = in_fresh_process("peer", _peer, args.data_path, args.model, args.img_size, args.batch_size, compute,
                                args.device, args.epochs)  # fmt: skip
    name = f"peer-style: ImageFolder, PIL, {worker_phrase(measured['workers'])}, pinned"
    yield row(name, "peer", 1, described(compute), measured, peaks[peak_name(compute.amp_dtype)], flops)


def as_run(args, name: str, peaks: dict) -> tuple[str, float]:
    """The precision and layout the run `name` trained in, as its args.json records what auto chose for it (a DDP
    run measures with its own share of the cores, and may choose otherwise than auto's row), and that precision's
    peak."""
    chose = json.loads((args.output_dir / "runs" / name / "args.json").read_text())
    compute = Compute(AMP_DTYPES[chose["amp"]], chose["channels_last"])
    return described(compute), peaks[peak_name(compute.amp_dtype)]


def predict_rows(args, nprocs: int, peaks: dict, measured: list[dict]):
    """predict.py after training (if --rows has it): in one process, then with --nprocs under torchrun, on every
    image of the data with auto's weights, each row yielded as soon as it is measured. Beside each, the training
    step's model-only ceiling, from the rows `measured` so far: what scoring an image costs against learning it."""
    if "predict" not in args.rows:
        return
    ceiling = next((row["img_per_sec"] for row in measured if row["kind"] == "model-only"), None)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    for processes, launcher in ((1, []), (nprocs, torchrun)):
        name = f"predict.py, {processes} process{'es' * (processes > 1)}" + (", torchrun" if launcher else "")
        figures = run_predict(args, f"predict-{processes}", [*launcher, str(ROOT / "predict.py")])
        figures["training_step_img_per_sec"] = ceiling
        yield row(name, "predict", processes, as_run(args, "auto", peaks)[0], figures)


def run_predict(args, name: str, script: list) -> dict:
    """predict.py (`script`: what follows `python`) with auto's best weights on the benchmark's data, into a
    results file; its speed from the line it ends with ("... (24.0 images/s, ...)")."""
    weights = args.output_dir / "runs" / "auto" / "weights" / "best.pth"
    results, log = args.output_dir / "runs" / f"{name}.csv", args.output_dir / "logs" / f"{name}.log"
    command = [sys.executable, *script, str(args.data_path), "--weights", str(weights), "--results", str(results)]
    command += ["--device", args.device]
    print(f"  {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    speed = re.search(r"\(([\d.]+) images/s", log.read_text())
    if result.returncode != 0 or speed is None:
        raise UserError(f"{name} failed (exit status {result.returncode}); see {log}")
    return {"img_per_sec": float(speed[1]), "run_seconds": time.perf_counter() - start}


def predict_figures(rows: list[dict]) -> list[str]:
    """predict.py's speed in one process and in several, and against the training step's model-only ceiling
    (no targets)."""
    predicted = rows_of(rows, "predict")
    if not predicted:
        return ["predict.py: not measured"]
    single, *several = predicted
    line = f"predict.py: {single['img_per_sec']:.1f} img/s in one process"
    for other in several:
        line += f", {other['img_per_sec'] / single['img_per_sec']:.2f}x that with {other['processes']} processes"
    if single["training_step_img_per_sec"]:
        line += f"; {single['img_per_sec'] / single['training_step_img_per_sec']:.1f}x the training step's model-only"
        line += f" ceiling ({single['training_step_img_per_sec']:.1f} img/s)"
    return [line + " (no target)"]


@entry_point
def main(argv=None):
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device} asked for a GPU but none is visible; use --device cpu")
    if args.startup_sizes:
        return startup_benchmark(args.startup_sizes, args.output_dir, args.device)
    nprocs = settle(args)
    print(
        f"Benchmark: {args.model}, {args.img_size} px, batch {args.batch_size}, data {args.data_path}, "
        f"output {args.output_dir}"
    )
    machine = describe_machine(args.device)
    print(f"Machine: {machine}")
    plan = training_plan(args.data_path, args.batch_size, args.output_dir)
    auto, compute, workers = auto_run(args)  # first: the rows below compute as it chose
    print(f"auto chose {described(compute)}, {worker_phrase(workers)}; measuring took {auto['measure_seconds']} s")
    fixed = [Compute(AMP_DTYPES[FIXED[name][0]]) for name in args.fixed]
    # every precision a row may train in: the DDP runs measure with their own share of the cores and may choose
    # another of auto's candidates than the single process did
    chosen_by_any = [Compute(AMP_DTYPES[amp]) for amp in amp_candidates(args.amp, torch.device(args.device))[0]]
    peaks = measure_peaks([compute, *fixed, *chosen_by_any], torch.device(args.device))
    flops = training_flops_per_image(args.model, args.img_size)
    print(
        "Compute peak (the faster of matrix products and convolutions): "
        + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peaks.items())
        + f"; a training step is {flops / 1e9:.2f} GFLOP per image"
    )  # fmt: skip
    settings = {"nprocs": nprocs, "precision": described(compute), "channels_last": compute.channels_last,
                "workers": workers, "peak_flops": peaks, "training_flops_per_image": flops}  # fmt: skip
    benchmark = new_benchmark(args, machine, settings)
    results = args.output_dir / "benchmark.json"
    print(f"\nRows as they are measured (of {', '.join(args.rows)}), each written to {results} at once:")
    print(TABLE_HEADER, flush=True)
    peak_auto = peaks[peak_name(compute.amp_dtype)]
    where = "batches made on the device" if compute.on_device else "batches by the loader"
    auto_row = row(f"train_single_gpu.py, auto ({where})", "auto", 1, described(compute), auto, peak_auto, flops)
    record(benchmark, auto_row, results)
    measured_rows = itertools.chain(
        in_memory_rows(args, compute, peaks, flops),
        loader_rows(args, plan, workers),
        peer_rows(args, compute, peaks, flops),
        profile_rows(args, plan, compute, workers),
        script_rows(args, compute, workers, nprocs, peaks, flops),
        predict_rows(args, nprocs, peaks, benchmark["rows"]),
    )
    for measured in measured_rows:  # each row measured, then recorded, before the next starts
        record(benchmark, measured, results)
    benchmark["complete"] = True
    write_json(results, benchmark)
    report(benchmark, args, results, native_bf16=compute.amp_dtype == torch.bfloat16)


def settle(args) -> int:
    """Fill in what the flags leave to the benchmark (the fixed configurations, the rows, the data: generated
    JPEGs), check the output folder is new, and keep auto's choices in the benchmark's own file; returns the
    number of processes of the DDP rows."""
    if args.fixed is None:  # float32 in both layouts; bfloat16 too where auto would consider it
        candidates = amp_candidates("auto", torch.device(args.device))[0]
        args.fixed = [name for name, (amp, _) in FIXED.items() if amp in candidates]
    left_out = ({"torchrun", "spawn"} if args.skip_ddp else set()) | ({"demo"} if args.skip_demo else set())
    args.rows = [kind for kind in KINDS if kind == "auto" or kind in args.rows and kind not in left_out]
    if "fixed" not in args.rows:
        args.fixed = []
    if args.data_path is None:
        width, height = FLOWER_PHOTOS_SIZE
        folder = ROOT / "data" / f"benchmark_flowers_{width}x{height}_{args.images_per_class}"
        args.data_path = make_demo_data(folder, images_per_class=args.images_per_class, size=FLOWER_PHOTOS_SIZE)
    if (args.output_dir / "runs").exists():
        raise UserError(f"{args.output_dir} already holds a benchmark: choose another --output-dir or remove it")
    # auto's choices go to the benchmark's own file, empty at the start: each benchmark measures anew, as a first
    # run does, and never reads or changes the user's
    os.environ[CACHE_ENV] = str((args.output_dir / "autotune.json").resolve())
    return args.nprocs or (torch.cuda.device_count() if args.device.startswith("cuda") else 2)


def new_benchmark(args, machine: str, settings: dict) -> dict:
    """benchmark.json before its first row: the machine, the date, torch, and the settings (the flags', and
    `settings`: what was measured or chosen before the rows)."""
    return {
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "settings": {
            "model": args.model, "img_size": args.img_size, "batch_size": args.batch_size, "device": args.device,
            **settings, "data_path": str(args.data_path), "epochs": args.epochs, "steps": args.steps,
            "loader_images": args.loader_images, "fixed": args.fixed, "rows": args.rows,
        },
        "complete": False,  # until the last row: a benchmark stopped midway leaves the rows it finished
        "rows": [],
    }  # fmt: skip


def report(benchmark: dict, args, results: Path, native_bf16: bool) -> None:
    """The chart, the whole table and the targets, at the end."""
    rows = benchmark["rows"]
    plot_benchmark(benchmark, args.output_dir / "benchmark.png")
    print(f"\n{benchmark['machine']}, torch {benchmark['torch']}, {benchmark['date']}\n")
    print(markdown_table(rows))
    print("\n" + "\n".join(against_targets(rows, native_bf16) + auto_targets(rows) + predict_figures(rows)))
    print(f"\nWrote {results} and {args.output_dir / 'benchmark.png'}")


if __name__ == "__main__":
    main()
