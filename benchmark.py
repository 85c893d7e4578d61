"""Measure training speed: the model alone, then each launch script end to end, against the original's setup.

python benchmark.py                       # 224 px, batch 16, generated 320x240 JPEGs
python benchmark.py --data-path flower_photos --img-size 224 --batch-size 32 --nprocs 4
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmark.py    # an AVX-512 CPU computing as an AVX2 one

Rows, each a fresh process (or group of processes) so that no row inherits another's warm caches or memory:
  model only     training steps on random tensors already in memory: the ceiling for this precision and layout
  baseline       train_single_gpu.py as the original scripts ran: float32, NCHW, loader workers restarted each epoch
  single         train_single_gpu.py with this collection's defaults (or --amp / --channels-last)
  torchrun, spawn   the two DDP launch scripts with --nprocs processes
End-to-end figures come from the runs' own metrics.jsonl: training images per second and epoch wall time
(training and validation) averaged over the epochs after the first, which pays one-off start-up costs.

The machine is stated with the figures: the processor, the instruction set torch computes with, the cores, and
the measured peak of a large matrix product in each precision; each row's "% of peak" is its training FLOPs per
second (torch's FlopCounterMode over one training step, times images per second) against the peak of the
precision it computed in. Writes benchmark.json, benchmark.png (plot_results.plot_benchmark) and each run's
folder and log to --output-dir.
"""

import argparse
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from compute import choose_compute
from demo_data import make_demo_data
from flags import DEFAULT_BATCH_SIZE, DEFAULT_IMG_SIZE
from machine import describe_cpu
from model import create_model
from multi_train_utils.distributed_utils import resolve_device
from multi_train_utils.train_eval_utils import train_one_epoch
from plot_results import plot_benchmark
from recipe import build_optimizer
from run_log import peak_memory
from training import build_model
from utils import Parser, UserError, entry_point, number, write_json

ROOT = Path(__file__).resolve().parent
FLOWER_PHOTOS_SIZE = (320, 240)  # about the size of the images in flower_photos


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--img-size", type=number(int, 1), default=DEFAULT_IMG_SIZE, help="training crop size")
    p.add_argument(
        "--batch-size", type=number(int, 1), default=DEFAULT_BATCH_SIZE, help="images per step in each process"
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
    p.add_argument("--steps", type=number(int, 1), default=20, help="timed steps of the model-only rows")
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
    return p.parse_args(argv)


def _model_only(queue, img_size, batch_size, amp, channels_last, device, steps):
    """In a fresh process: `steps` timed training steps on random tensors, after three untimed ones."""
    sys.stdout = open(os.devnull, "w")  # train_one_epoch's progress bar
    device = resolve_device(device)
    compute, summary = choose_compute(amp, channels_last, device, img_size)
    model, _ = build_model(5, device, compute)  # as the scripts build it, in one process
    # The training scripts' optimizer at their default settings (the step's cost does not depend on them).
    optimizer, _ = build_optimizer(
        model, lr=0.001, world_size=1, momentum=0.9, weight_decay=1e-4, epochs=1, lrf=0.1, steps_per_epoch=1
    )
    scaler = compute.grad_scaler(device)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, 3, img_size, img_size, generator=generator), torch.randint(0, 5, (batch_size,)))
    train_one_epoch(model, optimizer, [batch] * 3, device, 0, compute, scaler)  # warm-up: allocations, kernels
    start = time.perf_counter()
    _, images = train_one_epoch(model, optimizer, [batch] * steps, device, 0, compute, scaler)
    seconds = time.perf_counter() - start  # train_one_epoch reads each step's loss, so the device has finished
    queue.put(
        {
            "img_per_sec": images / seconds,
            "summary": summary,
            "amp_dtype": str(compute.amp_dtype),
            "channels_last": compute.channels_last,
            **peak_memory(device),
        }
    )


def model_only(args, amp: str, channels_last: bool | None) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(
        target=_model_only,
        args=(queue, args.img_size, args.batch_size, amp, channels_last, args.device, args.steps),
    )
    process.start()
    result = queue.get()
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


def row(name: str, kind: str, processes: int, precision: str, measured: dict, peak: float, flops: float) -> dict:
    """One line of the table; `peak` is the FLOP/s of the precision the row computed in."""
    measured = {key: value for key, value in measured.items() if key not in ("summary", "amp_dtype", "channels_last")}
    peak_fraction = measured["img_per_sec"] * flops / peak
    return {"name": name, "kind": kind, "processes": processes, "precision": precision, **measured,
            "peak_fraction": peak_fraction}  # fmt: skip


def against_targets(rows: list[dict], native_bf16: bool) -> list[str]:
    """The project's speed targets, each with its ratio measured in this run and whether it is met."""
    first = {}
    for row in rows:
        first.setdefault(row["kind"], row)  # of the model-only rows, the first: the ceiling
    ceiling, baseline, single = first["model-only"], first["baseline"], first["single"]
    over_baseline = 3.5 if native_bf16 else 1.15  # float32 alone is capped by the machine's float32 peak
    kind = "bfloat16 native" if native_bf16 else "float32 only"
    checks = [
        ("single process >= 90 % of the model-only ceiling", single["img_per_sec"] / ceiling["img_per_sec"], 0.9,
         "{:.0%}"),
        (f"single process >= {over_baseline}x the original's setup ({kind})",
         single["img_per_sec"] / baseline["img_per_sec"], over_baseline, "{:.2f}x"),
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
    return lines


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
        "peak_rss_mib": max(m["peak_rss_mib"] for m in epochs),
        **({"peak_gpu_mib": max(m["peak_gpu_mib"] for m in epochs)} if "peak_gpu_mib" in epochs[0] else {}),
    }


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
        lines.append(
            f"| {row['name']} | {row['processes']} | {row['precision']} | {row['img_per_sec']:.1f} "
            f"| {row['img_per_sec'] / baseline:.2f} | {row['peak_fraction']:.0%} | {epoch} | {first} "
            f"| {row['peak_rss_mib']} |"
        )
    return "\n".join(lines)


def measure_peaks(compute, device: torch.device) -> dict:
    """The matrix-product peak of float32 and of the precision measured, in FLOP/s, by name ("float32", ...)."""
    peaks = {"float32": matmul_peak(torch.float32, device)}
    if compute.amp_dtype is not None:
        peaks[str(compute.amp_dtype).removeprefix("torch.")] = matmul_peak(compute.amp_dtype, device)
    return peaks


def measure_rows(args, compute, precision: str, nprocs: int, peaks: dict, flops: float) -> list[dict]:
    """Every row of the table, each measured in fresh processes."""
    layout = "channels_last" if compute.channels_last else "NCHW"
    ours, fp32 = f"{precision}, {layout}", "float32, NCHW"
    peak_ours = peaks[str(compute.amp_dtype or torch.float32).removeprefix("torch.")]
    single = [str(ROOT / "train_single_gpu.py")]
    ours_flags = ["--amp", args.amp, "--channels-last" if compute.channels_last else "--no-channels-last"]
    original_workers = min(os.cpu_count() or 1, args.batch_size, 8)  # the original's num_workers
    baseline = ["--amp", "off", "--no-channels-last", "--no-persistent-workers", "--workers", str(original_workers)]
    rows = [
        row("model only (the ceiling)", "model-only", 1, ours, model_only(args, args.amp, compute.channels_last),
            peak_ours, flops),
        row("model only, float32 NCHW", "model-only", 1, fp32, model_only(args, "off", False), peaks["float32"], flops),
        row("baseline: the original's setup", "baseline", 1, fp32, run_script(args, "baseline", single, baseline),
            peaks["float32"], flops),
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
    rows = measure_rows(args, compute, precision, nprocs, peaks, flops)

    benchmark = {
        "machine": describe_machine(args.device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "settings": {
            "img_size": args.img_size, "batch_size": args.batch_size, "nprocs": nprocs, "device": args.device,
            "precision": precision, "channels_last": compute.channels_last, "matmul_peak_flops": peaks,
            "training_flops_per_image": flops, "data_path": str(args.data_path), "epochs": args.epochs,
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
