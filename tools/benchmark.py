"""Measure training speed: the model and the loader alone, then each launch script end to end.

python tools/benchmark.py                       # 224 px, batch 16, generated 320x240 JPEGs
python tools/benchmark.py --data-path flower_photos --img-size 224 --batch-size 32 --nprocs 4
python tools/benchmark.py --startup-sizes 1000,10000,100000   # start-up alone (tools/startup_benchmark.py)
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python tools/benchmark.py    # an AVX-512 CPU computing as an AVX2 one

Rows, each a fresh process (or group of processes) so that no row inherits another's warm caches or memory:
  model only (the ceiling)   the bare training step (autocast forward, cross-entropy, scaled backward, optimizer
                 step) on one random batch already on the device, with no host synchronisation inside the loop:
                 the ceiling for this precision and layout
  model only, loss.item() each step   the same, the CPU waiting for each step's loss before it queues the next
  model only, float32 NCHW   the ceiling's loop in float32 and NCHW
  train_one_epoch, tensors in memory   the training loop itself, fed one batch from host memory at every step
  loader         the training loader as the scripts build it, iterated without a model: with 1 worker, and with
                 the workers the scripts use on this device (at least 1); images per second after the first
                 batches, at least --loader-images of them
  baseline       train_single_gpu.py as the original scripts ran: float32, NCHW, loader workers restarted each epoch
  single         train_single_gpu.py with this collection's defaults (or --amp / --channels-last)
  torchrun, spawn   the two DDP launch scripts with --nprocs processes
The rows without a loader time --steps steps after 3 untimed ones, the device synchronised before the clock starts
and before it stops. End-to-end figures come from the runs' own metrics.jsonl: training images per second and
epoch wall time (training and validation) averaged over the epochs after the first, which pays one-off start-up
costs.

The machine is stated with the figures: the processor, the instruction set torch computes with, the cores, and
the measured peak of a large matrix product in each precision; each row's "% of peak" is its training FLOPs per
second (torch's FlopCounterMode over one training step, times images per second) against the peak of the
precision it computed in (none for the loader rows, which do not train). Writes benchmark.json, benchmark.png
(plot_results.plot_benchmark) and each run's folder and log to --output-dir.
"""

import argparse
import datetime
import functools
import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty

import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project's modules, for `python tools/benchmark.py` from anywhere

from model import create_model, initial_model  # noqa: E402
from multi_train_utils.distributed_utils import resolve_device, shuffled_batches  # noqa: E402
from multi_train_utils.train_eval_utils import Training, train_one_epoch  # noqa: E402
from my_dataset import datasets, read_split_data  # noqa: E402
from plot_results import plot_benchmark  # noqa: E402
from plumbing.compute import choose_compute  # noqa: E402
from plumbing.config import SINGLE, Config, parse_config  # noqa: E402
from plumbing.demo_data import make_demo_data  # noqa: E402
from plumbing.machine import core_budget, describe_cpu  # noqa: E402
from plumbing.recipe import build_optimizer  # noqa: E402
from plumbing.run_log import peak_memory  # noqa: E402
from tools.startup_benchmark import image_counts, startup_benchmark  # noqa: E402
from utils import Parser, UserError, entry_point, number, write_json  # noqa: E402

FLOWER_PHOTOS_SIZE = (320, 240)  # about the size of the images in flower_photos


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--img-size", type=number(int, 1), default=Config.default("img_size"), help="training crop size")
    p.add_argument(
        "--batch-size",
        type=number(int, 1),
        default=Config.default("batch_size"),
        help="images per step in each process",
    )
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
    p.add_argument("--nprocs", type=number(int, 1), help="DDP processes (default: GPUs visible, or 2 on the CPU)")
    p.add_argument("--amp", choices=["auto", "off", "bf16", "fp16"], default="auto", help="precision to measure")
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        help="NHWC layout (default: as the training scripts choose it for this device and image size)",
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--output-dir", type=Path, default=Path("benchmark"), help="where results and runs go")
    p.add_argument("--skip-ddp", action="store_true", help="measure the single-process rows only")
    p.add_argument(
        "--startup-sizes",
        type=image_counts,
        help="measure start-up alone instead: seconds to the first training step, cold and warm, on generated "
        "folders of these many images (e.g. 1000,10000,100000); see tools/startup_benchmark.py",
    )
    return p.parse_args(argv)


def _in_memory(queue, mode, img_size, batch_size, amp, channels_last, device, steps):
    """In a fresh process: `steps` timed training steps on one random batch held in memory, after three untimed
    ones (allocations, kernel choices). `mode` "bare": the step alone, the batch on the device once; "item": the
    same with loss.item() after each step; "loop": train_one_epoch, which moves the batch to the device and
    reads the loss at every step, as training does."""
    sys.stdout = open(os.devnull, "w")  # train_one_epoch's progress bar
    device = resolve_device(device)
    compute, _ = choose_compute(amp, channels_last, device, img_size)
    model = initial_model("resnet34", 5, device, compute.memory_format)  # as the scripts build it, in one process
    # The training scripts' optimizer at their default settings (the step's cost does not depend on them).
    optimizer, _ = build_optimizer(model, parse_config(SINGLE, "", []), batches_per_epoch=1)
    scaler = compute.grad_scaler(device)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, 3, img_size, img_size, generator=generator), torch.randint(0, 5, (batch_size,)))
    if mode == "loop":
        run = functools.partial(loop_steps, model, optimizer, scaler, compute, device, batch)
    else:
        on_device = compute.batch_to(batch[0], device), batch[1].to(device)
        run = functools.partial(bare_steps, model, optimizer, scaler, compute, on_device, host_sync=mode == "item")
    run(3)
    synchronize(device)
    start = time.perf_counter()
    run(steps)
    synchronize(device)  # the clock stops when the device has finished the queued steps, not when they are queued
    seconds = time.perf_counter() - start
    queue.put(
        {"img_per_sec": steps * batch_size / seconds, "host_sync_each_step": mode != "bare", **peak_memory(device)}
    )


def bare_steps(model, optimizer, scaler, compute, batch, steps: int, host_sync: bool) -> None:
    """`steps` training steps on `batch` (images and labels on the device): forward under autocast,
    cross-entropy, the scaled backward pass and the optimizer's step. With `host_sync`, loss.item() after each
    step, as a loop that logs or checks every step's loss does: the CPU waits for the device, so it cannot queue
    the next step's work while the device computes this one."""
    images, labels = batch
    model.train()
    for _ in range(steps):
        with compute.autocast(images.device):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if host_sync:
            loss.item()


def loop_steps(model, optimizer, scaler, compute, device, batch, steps: int) -> None:
    """`steps` training steps through train_one_epoch, `batch` (in host memory) standing in for the loader."""
    train_one_epoch(Training(model, optimizer, compute=compute, scaler=scaler), [batch] * steps, device, 0)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it (the CPU computes as it is asked: nothing to do)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loader(queue, split, img_size, batch_size, workers, images, start_method, pin_memory):
    """In a fresh process: images per second of the training loader as the training scripts build it (at their
    default settings; batches in pinned memory for a GPU), iterated without a model. Its workers start as
    they do in train_single_gpu.py: by `start_method`, the platform's default (this process was started by the
    forkserver, and would otherwise start them that way too).

    The first max(2, workers) batches are not timed: the workers start and fill their queues. Then at least
    `images` images, in whole rounds of `workers` batches (the workers deliver batches in turn, each its own),
    over as many epochs as that takes."""
    multiprocessing.set_start_method(start_method, force=True)
    train_set, _ = datasets(split, Config(img_size=img_size))  # the scripts' wiring, at their default settings
    batches = shuffled_batches(train_set, batch_size, seed=0)
    loader = DataLoader(
        train_set, batch_sampler=batches, num_workers=workers, persistent_workers=workers > 0, pin_memory=pin_memory
    )
    batches = batches_over_epochs(loader)
    for _ in range(max(2, workers)):
        next(batches)
    rounds = math.ceil(math.ceil(images / batch_size) / workers)
    start = time.perf_counter()
    loaded = sum(len(next(batches)[1]) for _ in range(rounds * workers))
    seconds = time.perf_counter() - start
    queue.put({"img_per_sec": loaded / seconds, "workers": workers, **peak_memory(torch.device("cpu"))})


def batches_over_epochs(loader):
    """The loader's batches, epoch after epoch without end, each epoch with its own shuffle as in training."""
    for epoch in itertools.count():
        loader.batch_sampler.set_epoch(epoch)
        yield from loader


def in_fresh_process(name: str, target, *args) -> dict:
    """What `target(queue, *args)` puts on the queue, run in a new process: no warm caches, no memory or threads
    left over from another row. Each is forked from multiprocessing's forkserver, a process that has imported this
    module (torch and torchvision with it) and run nothing, so a row does not spend seconds importing them anew."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", __name__])  # takes effect when the server starts, with the first row
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


def matmul_peak(dtype: torch.dtype, device: torch.device, size: int = 2048) -> float:
    """FLOP/s of a size x size matrix product in `dtype` on all of this process's cores: the machine's practical
    peak in that precision (the best of several timed products, after a warm-up)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        (a @ b).sum().item()  # .item() waits for a GPU to finish
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def training_flops_per_image(img_size: int) -> float:
    """Floating-point operations of one training step (forward and backward) of the model, per image."""
    model, batch = create_model(5), 2
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
    """The project's speed targets, each with its ratio measured in this run and whether it is met, and what the
    per-step loss.item() costs (no target)."""
    first = {}
    for row in rows:
        first.setdefault(row["kind"], row)  # of the model-only rows, the first: the ceiling
    ceiling, baseline, single = first["model-only"], first["baseline"], first["single"]
    loader = rows_of(rows, "loader")[-1]  # with the training scripts' workers
    over_baseline = 3.5 if native_bf16 else 1.15  # float32 alone is capped by the machine's float32 peak
    kind = "bfloat16 native" if native_bf16 else "float32 only"
    checks = [
        ("single process >= 90 % of the model-only ceiling", single["img_per_sec"] / ceiling["img_per_sec"], 0.9,
         "{:.0%}"),
        (f"single process >= {over_baseline}x the original's setup ({kind})",
         single["img_per_sec"] / baseline["img_per_sec"], over_baseline, "{:.2f}x"),
        (f"loader with {worker_phrase(loader['workers'])} feeds {loader['img_per_sec']:.1f} img/s, >= the model-only "
         "ceiling", loader["img_per_sec"] / ceiling["img_per_sec"], 1.0, "{:.2f}x"),
    ]  # fmt: skip
    for kind in ("torchrun", "spawn"):
        if kind in first:
            ratio = first[kind]["img_per_sec"] / single["img_per_sec"]
            checks.append((f"{kind}, {first[kind]['processes']} processes >= 0.8x one process", ratio, 0.8, "{:.2f}x"))
    lines = [
        f"{what}: {form.format(value)} ({'met' if value >= goal else 'NOT met'})" for what, value, goal, form in checks
    ]
    if "spawn" in first and "torchrun" in first:
        ratio = first["spawn"]["epoch_seconds"] / first["torchrun"]["epoch_seconds"]
        lines.append(
            f"spawn's epoch takes {ratio:.0%} of torchrun's ({'met' if ratio <= 1.1 else 'NOT met'}: <= 110 %)"
        )
    synced = next(row for row in rows_of(rows, "model-only") if row["host_sync_each_step"])
    cost = 1 - synced["img_per_sec"] / ceiling["img_per_sec"]
    return [*lines, f"loss.item() each step costs {cost:.0%} of the ceiling's speed (no target)"]


def rows_of(rows: list[dict], kind: str) -> list[dict]:
    return [row for row in rows if row["kind"] == kind]


def worker_phrase(count: int) -> str:
    return f"{count} worker{'s' * (count != 1)}"


def run_script(args, name: str, script: list, flags: list) -> dict:
    """Train with a script (`script`: what follows `python`); speed and memory from the metrics.jsonl it writes."""
    out = args.output_dir / "runs" / name
    command = [sys.executable, *script, "--data-path", str(args.data_path)]
    command += ["--output-dir", str(out), "--img-size", str(args.img_size), "--batch-size", str(args.batch_size)]
    command += ["--epochs", str(args.epochs), "--device", args.device, *flags]
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


def training_split(data_path: Path, batch_size: int):
    """The training scripts' split of the data at their default --val-rate and --seed, unreadable images left
    out; UserError if it holds less than one batch of training images."""
    split = read_split_data(data_path, verify_images=True)
    if len(split.train_images) < batch_size:
        raise UserError(f"{data_path}: {len(split.train_images)} training images, fewer than a batch of {batch_size}")
    return split


def describe_machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{describe_cpu()}; {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{describe_cpu()}; no GPU used"


def markdown_table(rows: list[dict]) -> str:
    baseline = next(row["img_per_sec"] for row in rows if row["kind"] == "baseline")
    lines = [
        "| configuration | processes | precision, layout | img/s | × baseline | % of peak | epoch (s) "
        "| first epoch (s) | peak RSS / process (MiB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        epoch = f"{row['epoch_seconds']:.1f}" if row.get("epoch_seconds") else "–"
        first = f"{row['first_epoch_seconds']:.1f}" if row.get("first_epoch_seconds") else "–"
        peak = f"{row['peak_fraction']:.0%}" if row["peak_fraction"] is not None else "–"
        lines.append(
            f"| {row['name']} | {row['processes']} | {row['precision']} | {row['img_per_sec']:.1f} "
            f"| {row['img_per_sec'] / baseline:.2f} | {peak} | {epoch} | {first} "
            f"| {row.get('peak_rss_mib') or '–'} |"  # none where the OS does not tell (Windows without psutil)
        )
    return "\n".join(lines)


def measure_peaks(compute, device: torch.device) -> dict:
    """The matrix-product peak of float32 and of the precision measured, in FLOP/s, by name ("float32", ...)."""
    peaks = {"float32": matmul_peak(torch.float32, device)}
    if compute.amp_dtype is not None:
        peaks[str(compute.amp_dtype).removeprefix("torch.")] = matmul_peak(compute.amp_dtype, device)
    return peaks


def measure_rows(args, compute, precision: str, nprocs: int, peaks: dict, flops: float, split) -> list[dict]:
    """Every row of the table, each measured in fresh processes."""
    layout = "channels_last" if compute.channels_last else "NCHW"
    ours = f"{precision}, {layout}"
    peak_ours = peaks[str(compute.amp_dtype or torch.float32).removeprefix("torch.")]
    rows = in_memory_rows(args, compute, ours, peak_ours, peaks["float32"], flops) + loader_rows(args, split)
    return rows + script_rows(args, compute, ours, nprocs, peak_ours, peaks["float32"], flops)


def in_memory_rows(args, compute, ours: str, peak_ours: float, peak_fp32: float, flops: float) -> list[dict]:
    """The rows without a data loader: the bare training step (the first: the ceiling), the same with loss.item()
    each step, the same in float32 NCHW, and train_one_epoch's loop over a batch in memory."""
    fp32, channels_last = "float32, NCHW", compute.channels_last
    cases = [  # name, kind, _in_memory's mode, --amp, channels_last, precision and layout, peak FLOP/s
        ("model only (the ceiling)", "model-only", "bare", args.amp, channels_last, ours, peak_ours),
        ("model only, loss.item() each step", "model-only", "item", args.amp, channels_last, ours, peak_ours),
        ("model only, float32 NCHW", "model-only", "bare", "off", False, fp32, peak_fp32),
        ("train_one_epoch, tensors in memory", "loop", "loop", args.amp, channels_last, ours, peak_ours),
    ]
    settings = (args.img_size, args.batch_size)
    return [
        row(name, kind, 1, precision,
            in_fresh_process(name, _in_memory, mode, *settings, amp, layout, args.device, args.steps), peak, flops)
        for name, kind, mode, amp, layout, precision, peak in cases
    ]  # fmt: skip


def loader_rows(args, split) -> list[dict]:
    """The training loader alone: with one worker (what one worker supplies) and with the workers the training
    scripts use on this device, at least one (where the scripts use none, they load between steps)."""
    device = torch.device(args.device)
    scripts = core_budget(device, 1, args.batch_size)[0]
    if scripts == 0:
        theirs = "loader, 1 worker (the training scripts here: none, images loaded between steps)"
    else:
        theirs = f"loader, {worker_phrase(scripts)} (as the training scripts)"
    start_method = multiprocessing.get_start_method()  # what a script's loader gets: the platform's default
    rows = []
    for count, name in ((1, "loader, 1 worker"), (max(1, scripts), theirs)):
        measure = (split, args.img_size, args.batch_size, count, args.loader_images, start_method)
        measure += (device.type == "cuda",)  # pinned, as train() asks on a GPU
        measured = in_fresh_process(name, _loader, *measure)
        measured["img_per_sec_per_worker"] = measured["img_per_sec"] / count
        rows.append(row(name, "loader", 1, "–", measured))
    return rows


def script_rows(args, compute, ours: str, nprocs: int, peak_ours: float, peak_fp32: float, flops: float):
    """The training scripts end to end: the original's setup, train_single_gpu.py and (unless --skip-ddp) the
    two DDP launch scripts."""
    single = [str(ROOT / "train_single_gpu.py")]
    ours_flags = ["--amp", args.amp, "--channels-last" if compute.channels_last else "--no-channels-last"]
    original_workers = min(os.cpu_count() or 1, args.batch_size, 8)  # the original's num_workers
    baseline = ["--amp", "off", "--no-channels-last", "--no-persistent-workers", "--workers", str(original_workers)]
    rows = [
        row("baseline: the original's setup", "baseline", 1, "float32, NCHW",
            run_script(args, "baseline", single, baseline), peak_fp32, flops),
        row("train_single_gpu.py", "single", 1, ours, run_script(args, "single", single, ours_flags), peak_ours, flops),
    ]  # fmt: skip
    if not args.skip_ddp:
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
        launch = [*torchrun, str(ROOT / "train_multi_gpu_using_launch.py")]
        spawn = [str(ROOT / "train_multi_gpu_using_spawn.py")]
        rows += [
            row(f"torchrun, {nprocs} processes", "torchrun", nprocs, ours,
                run_script(args, "torchrun", launch, ours_flags), peak_ours, flops),
            row(f"spawn, {nprocs} processes", "spawn", nprocs, ours,
                run_script(args, "spawn", spawn, [*ours_flags, "--world-size", str(nprocs)]), peak_ours, flops),
        ]  # fmt: skip
    return rows


@entry_point
def main(argv=None):
    args = parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device} asked for a GPU but none is visible; use --device cpu")
    if args.startup_sizes:
        return startup_benchmark(args.startup_sizes, args.output_dir, args.device)
    nprocs = args.nprocs or (torch.cuda.device_count() if args.device.startswith("cuda") else 2)
    if args.data_path is None:
        width, height = FLOWER_PHOTOS_SIZE
        folder = ROOT / "data" / f"benchmark_flowers_{width}x{height}_{args.images_per_class}"
        args.data_path = make_demo_data(folder, images_per_class=args.images_per_class, size=FLOWER_PHOTOS_SIZE)
    if (args.output_dir / "runs").exists():
        raise UserError(f"{args.output_dir} already holds a benchmark: choose another --output-dir or remove it")

    device = torch.device(args.device)
    compute, summary = choose_compute(args.amp, args.channels_last, device, args.img_size)
    precision = summary.split(" (")[0].removeprefix("Precision: ")  # e.g. "bfloat16 autocast"
    print(f"Benchmark: {args.img_size} px, batch {args.batch_size}, data {args.data_path}, output {args.output_dir}")
    print(f"Machine: {describe_machine(args.device)}; {summary}")
    peaks, flops = measure_peaks(compute, device), training_flops_per_image(args.img_size)
    print(
        "Matrix-product peak: " + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peaks.items())
        + f"; a training step is {flops / 1e9:.2f} GFLOP per image"
    )  # fmt: skip
    rows = measure_rows(args, compute, precision, nprocs, peaks, flops, training_split(args.data_path, args.batch_size))

    benchmark = {
        "machine": describe_machine(args.device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "settings": {
            "img_size": args.img_size, "batch_size": args.batch_size, "nprocs": nprocs, "device": args.device,
            "precision": precision, "channels_last": compute.channels_last, "matmul_peak_flops": peaks,
            "training_flops_per_image": flops, "data_path": str(args.data_path), "epochs": args.epochs,
            "steps": args.steps, "loader_images": args.loader_images,
        },
        "rows": rows,
    }  # fmt: skip
    write_json(args.output_dir / "benchmark.json", benchmark)

    plot_benchmark(benchmark, args.output_dir / "benchmark.png")
    print(f"\n{benchmark['machine']}, torch {benchmark['torch']}, {benchmark['date']}\n")
    print(markdown_table(rows))
    print("\n" + "\n".join(against_targets(rows, native_bf16=compute.amp_dtype == torch.bfloat16)))
    print(f"\nWrote {args.output_dir / 'benchmark.json'} and {args.output_dir / 'benchmark.png'}")


if __name__ == "__main__":
    main()
