"""Measure training speed: the model and the loader alone, then each launch script end to end.

Each row runs in fresh processes, after auto's run (the rows without a script compute as it chose); benchmark.json
is rewritten after every row. docs/performance.md ("The benchmark") says what each row measures."""

import argparse
import datetime
import itertools
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `python tools/benchmark.py` from anywhere

from autotune.choose import amp_candidates  # noqa: E402
from autotune.remembered import CACHE_ENV  # noqa: E402
from dataset.demo import make_demo_data  # noqa: E402
from dataset.folders import read_split_data, unreadable_images  # noqa: E402
from dataset.store import StoredImages, store_folder  # noqa: E402
from dataset.transforms import decode_sides  # noqa: E402
from machine import describe_cpu  # noqa: E402
from multi_train_utils.train_eval_utils import Choice  # noqa: E402
from plot_results import plot_benchmark  # noqa: E402
from run.config import SINGLE, Config, model_name, parse_config  # noqa: E402
from run.plan import Plan  # noqa: E402
from tools import fresh_rows, script_rows  # noqa: E402
from tools.compute_peak import described, measure_peaks, trained_row, training_flops_per_image, worker_phrase  # noqa: E402
from tools.script_rows import FIXED  # noqa: E402
from tools.startup_benchmark import image_counts, startup_benchmark  # noqa: E402
from utils import Parser, UserError, check_writable, entry_point, number, positive_int, write_json  # noqa: E402

# benchmark.json's "kind" of row, in the order of the table
KINDS = ("model-only", "compile", "loader", "peer", "timm", "profile", "baseline", "fixed", "auto", "later", "paths",
         "torchrun", "spawn", "demo", "predict")  # fmt: skip
TABLE_HEADER = (
    "| configuration | processes | precision, layout | img/s | × baseline | % of peak | epoch (s) "
    "| first epoch (s) | peak RSS / process (MiB) |\n|---|---:|---|---:|---:|---:|---:|---:|---:|"
)


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--img-size", type=positive_int, default=Config.default("img_size"), help="training crop size")
    p.add_argument("--model", type=model_name, default=Config.default("model"), help="the network every row trains")
    p.add_argument("--batch-size", type=positive_int, default=Config.default("batch_size"), help="a process's batch")
    p.add_argument("--data-path", type=Path, help="a class-per-folder dataset (default: generated 320x240 JPEGs)")
    p.add_argument("--epochs", type=number(int, 2), default=3, help="epochs per run; the first is not averaged")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps of the model-only rows")
    p.add_argument("--loader-images", type=positive_int, default=512, help="timed images of the loader rows")
    p.add_argument("--profile-steps", type=positive_int, default=10, help="steps traced, of the second epoch")
    p.add_argument("--nprocs", type=positive_int, help="DDP processes (default: GPUs visible, or 2 on the CPU)")
    p.add_argument("--fixed", type=names_of(FIXED, "none"), help="configurations beside auto, comma-separated, of "
                   f"{', '.join(FIXED)} or none (default: float32's, and bf16's where bfloat16 is native)")  # fmt: skip
    p.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--output-dir", type=Path, default=Path("benchmark"), help="where results and runs go")
    p.add_argument("--rows", type=names_of(KINDS, "all"), default="all", help="the kinds of row measured, "
                   f"comma-separated, of {', '.join(KINDS)} (auto always runs; docs/performance.md)")  # fmt: skip
    p.add_argument("--skip-ddp", action="store_true", help="leave out the torchrun and spawn rows")
    p.add_argument("--skip-demo", action="store_true", help="leave out the demo's run (a minute or two on a CPU)")
    p.add_argument("--timm-train", type=Path, help="timm's train.py (the top of a pytorch-image-models checkout, "
                   "not in timm's package): a row of it on the same images (default: left out)")  # fmt: skip
    p.add_argument("--startup-sizes", type=image_counts, help="measure start-up alone, on generated folders of these "
                   "many photo-like images (e.g. 5000,20000): tools/startup_benchmark.py")  # fmt: skip
    return p.parse_args(argv)


def names_of(known, every: str):
    """argparse type: comma-separated `known` names; `every` stands for all of them ("none": none)."""

    def names(text: str) -> list[str]:
        chosen = (list(known) if every == "all" else []) if text == every else text.split(",")
        unknown = [name for name in chosen if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(known)}")
        return chosen

    return names


@entry_point
def main(argv=None):
    args = parse_args(argv)
    check_writable(args.output_dir)  # before anything is measured, not at the first row's log
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device} asked for a GPU but none is visible; use --device cpu")
    if args.startup_sizes:
        return startup_benchmark(args.startup_sizes, args.output_dir, args.device)
    nprocs = settle(args)
    print(f"Benchmark: {args.model}, {args.img_size} px, batch {args.batch_size}, data {args.data_path}, "
          f"output {args.output_dir}")  # fmt: skip
    gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if args.device.startswith("cuda") else None
    machine = f"{describe_cpu()}; {gpus or 'no GPU used'}"
    print(f"Machine: {machine}")
    stored = StoredImages(store_folder(None), decode_sides(args.img_size), None, fallback=unreadable_images)
    split = read_split_data(args.data_path, verify_images=stored)
    print(stored.line)
    if len(split.train_images) < args.batch_size:
        raise UserError(f"{args.data_path}: {len(split.train_images)} training images, fewer than a batch of "
                        f"{args.batch_size}")  # fmt: skip
    auto, choice = script_rows.auto_run(args)  # first: the rows below compute as it chose
    print(f"auto chose {described(choice)}, {worker_phrase(choice.workers)}; measuring took "
          f"{auto['measure_seconds']} s")  # fmt: skip
    benchmark, results = new_benchmark(args, machine, nprocs, choice), args.output_dir / "benchmark.json"
    peaks, flops = benchmark["settings"]["peak_flops"], benchmark["settings"]["training_flops_per_image"]
    print(f"\nRows as they are measured (of {', '.join(args.rows)}), each written to {results} at once:")
    print(TABLE_HEADER, flush=True)
    where = "batches made on the device" if choice.on_device else "batches by the loader"
    record(benchmark, trained_row(f"train_single_gpu.py, auto ({where})", "auto", 1, choice, auto, peaks, flops),
           results)  # fmt: skip
    config = parse_config(SINGLE, "", [*script_rows.settings_flags(args), "--device", args.device])
    plan = Plan(args.data_path, split, args.output_dir, store=stored.path)
    measured_rows = itertools.chain(  # each a generator: a row is measured only when the one before is recorded
        fresh_rows.fresh_rows(args, config, plan, choice, peaks, flops),
        script_rows.timm_rows(args, choice, split, peaks, flops),
        script_rows.script_rows(args, choice, nprocs, peaks, flops),
        script_rows.predict_rows(args, nprocs, benchmark["rows"]),
    )
    for measured in measured_rows:
        record(benchmark, measured, results)
    benchmark["complete"] = True
    write_json(results, benchmark)
    plot_benchmark(benchmark, args.output_dir / "benchmark.png")
    rows = benchmark["rows"]
    print(f"\n{benchmark['machine']}, torch {benchmark['torch']}, {benchmark['date']}\n\n{markdown_table(rows)}")
    targets = against_targets(rows, choice.amp == "bf16") + against_peers(rows) + auto_targets(rows)
    print("\n" + "\n".join(targets + predict_figures(rows)))
    print(f"\nWrote {results} and {args.output_dir / 'benchmark.png'}")


def settle(args) -> int:
    """Fill in what the flags leave to the benchmark; returns the number of processes of the DDP rows."""
    if args.fixed is None:  # float32; bfloat16 too where auto would consider it
        candidates = amp_candidates("auto", torch.device(args.device))[0]
        args.fixed = [name for name, (amp, _) in FIXED.items() if amp in candidates]
    left_out = ({"torchrun", "spawn"} if args.skip_ddp else set()) | ({"demo"} if args.skip_demo else set())
    args.rows = [kind for kind in KINDS if kind == "auto" or kind in args.rows and kind not in left_out]
    if "fixed" not in args.rows:
        args.fixed = []
    if args.data_path is None:
        folder = ROOT / "data" / "benchmark_flowers_320x240_60"
        args.data_path = make_demo_data(folder, images_per_class=60, size=(320, 240))
    if (args.output_dir / "runs").exists():
        raise UserError(f"{args.output_dir} already holds a benchmark: choose another --output-dir or remove it")
    # auto's choices go to the benchmark's own, new file: it measures as a first run does, and leaves the user's alone
    os.environ[CACHE_ENV] = str((args.output_dir / "autotune.json").resolve())
    return args.nprocs or (torch.cuda.device_count() if args.device.startswith("cuda") else 2)


def new_benchmark(args, machine: str, nprocs: int, choice: Choice) -> dict:
    """benchmark.json before its first row, with the compute peak of every precision a row may train in (auto's
    candidates too) and a step's FLOPs per image, which it prints."""
    device = torch.device(args.device)
    fixed, candidates = [FIXED[name][0] for name in args.fixed], amp_candidates("auto", device)[0]
    peaks = measure_peaks([choice, *map(Choice, fixed), *map(Choice, candidates)], device)
    flops = training_flops_per_image(args.model, args.img_size)
    print("Compute peak (the faster of matrix products and convolutions): "
          + ", ".join(f"{name} {value / 1e9:.0f} GFLOP/s" for name, value in peaks.items())
          + f"; a training step is {flops / 1e9:.2f} GFLOP per image")  # fmt: skip
    settings = {"model": args.model, "img_size": args.img_size, "batch_size": args.batch_size, "device": args.device,
                "nprocs": nprocs, "precision": described(choice), "channels_last": choice.channels_last,
                "workers": choice.workers, "peak_flops": peaks, "training_flops_per_image": flops,
                "data_path": str(args.data_path), "epochs": args.epochs, "steps": args.steps,
                "loader_images": args.loader_images, "fixed": args.fixed, "rows": args.rows}  # fmt: skip
    return {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "settings": settings, "complete": False, "rows": []}  # fmt: skip


def record(benchmark: dict, new_row: dict, path: Path) -> None:
    """Add a row in its place (the order of KINDS), print its line, and write the benchmark anew (write_json)."""
    benchmark["rows"].append(new_row)
    benchmark["rows"].sort(key=lambda row: KINDS.index(row["kind"]))  # stable: rows of a kind stay in measured order
    print(table_line(new_row, first_of(benchmark["rows"], "baseline")), flush=True)
    write_json(path, benchmark)


def markdown_table(rows: list[dict]) -> str:
    return "\n".join([TABLE_HEADER, *(table_line(row, first_of(rows, "baseline")) for row in rows)])


def table_line(row: dict, baseline: dict | None) -> str:
    epoch = f"{row['epoch_seconds']:.1f}" if row.get("epoch_seconds") else "–"
    first = f"{row['first_epoch_seconds']:.1f}" if row.get("first_epoch_seconds") else "–"
    peak = f"{row['peak_fraction']:.0%}" if row["peak_fraction"] is not None else "–"
    times = f"{row['img_per_sec'] / baseline['img_per_sec']:.2f}" if baseline else "–"
    memory = row.get("peak_rss_mib") or "–"  # none where the OS does not tell (Windows without psutil)
    return (f"| {row['name']} | {row['processes']} | {row['precision']} | {row['img_per_sec']:.1f} | {times} | {peak} "
            f"| {epoch} | {first} | {memory} |")  # fmt: skip


def against_targets(rows: list[dict], native_bf16: bool) -> list[str]:
    """The project's speed targets, each with this run's ratio and whether it is met."""
    ceiling, baseline, single = (first_of(rows, kind) for kind in ("model-only", "baseline", "auto"))
    loader = (rows_of(rows, "loader") or [None])[-1]  # with the training scripts' workers
    over_baseline = 3.5 if native_bf16 else 1.15  # float32 alone is capped by the machine's float32 peak
    kind = "bfloat16 native" if native_bf16 else "float32 only"
    feeds = (f"loader with {worker_phrase(loader['workers'])} feeds {loader['img_per_sec']:.1f} img/s" if loader
             else "loader with the training scripts' workers")  # fmt: skip
    lines = [
        ratio_target("single process >= 90 % of the model-only ceiling", single, ceiling, 0.9, "{:.0%}"),
        ratio_target(f"single process >= {over_baseline}x the original's setup ({kind})", single, baseline,
                     over_baseline, "{:.2f}x"),
        ratio_target(f"{feeds}, >= the model-only ceiling", loader, ceiling, 1.0, "{:.2f}x"),
    ]  # fmt: skip
    torchrun, spawn = first_of(rows, "torchrun"), first_of(rows, "spawn")
    for kind, ddp in (("torchrun", torchrun), ("spawn", spawn)):
        processes = f", {ddp['processes']} processes" if ddp else ""
        lines.append(ratio_target(f"{kind}{processes} >= 0.8x one process", ddp, single, 0.8, "{:.2f}x"))
    if spawn and torchrun:
        ratio = spawn["epoch_seconds"] / torchrun["epoch_seconds"]
        met = "met" if ratio <= 1.1 else "NOT met"
        lines.append(f"spawn's epoch takes {ratio:.0%} of torchrun's ({met}: <= 110 %)")
    else:
        lines.append("spawn's epoch within 110 % of torchrun's: not measured")
    return lines


def against_peers(rows: list[dict]) -> list[str]:
    """train_single_gpu.py (a later run, else auto's first) against the ceiling, the peer-style loader and timm's."""
    ours = first_of(rows, "later") or first_of(rows, "auto")
    ceiling, peer, timm = (first_of(rows, kind) for kind in ("model-only", "peer", "timm"))
    lines = [ratio_target("train_single_gpu.py >= 95 % of the model-only ceiling", ours, ceiling, 0.95, "{:.0%}")]
    for name, theirs in (("the peer-style loader", peer), ("timm's train.py", timm)):
        lines.append(ratio_target(f"train_single_gpu.py ahead of {name}", ours, theirs, 1.0, "{:.2f}x"))
        if first_of(rows, "later") is None or theirs is None:
            lines.append(f"the whole run against {name}'s: not measured (the later and {name} rows)")
            continue
        share = ours["run_seconds"] / theirs["run_seconds"]
        lines.append(f"the whole run: {ours['run_seconds']:.1f} s against {name}'s {theirs['run_seconds']:.1f} s, "
                     f"{share:.2f} of its time ({'met' if share < 1 else 'NOT met'}: < 1)")  # fmt: skip
    return lines


def ratio_target(what: str, row: dict | None, against: dict | None, goal: float, form: str) -> str:
    """`what`: row's images per second over against's, and whether that reaches `goal`."""
    if row is None or against is None:
        return f"{what}: not measured"
    value = row["img_per_sec"] / against["img_per_sec"]
    return f"{what}: {form.format(value)} ({'met' if value >= goal else 'NOT met'})"


def auto_targets(rows: list[dict]) -> list[str]:
    """auto's targets: its speed against the fixed configurations, its measuring's cost, the demo's time, accuracy."""
    auto, fixed = first_of(rows, "auto"), rows_of(rows, "fixed")
    verdict = lambda met: "met" if met else "NOT met"  # noqa: E731
    best = max(fixed, key=lambda row: row["img_per_sec"], default=None)
    original = next((row for row in fixed if row["precision"] == "float32, NCHW"), None)
    best_named = f"the best fixed configuration ({best['precision']})" if best else "the best fixed configuration"
    lines = [
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


def predict_figures(rows: list[dict]) -> list[str]:
    """predict.py's speed in one process and in several, and against the model-only ceiling."""
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


def rows_of(rows: list[dict], kind: str) -> list[dict]:
    return [row for row in rows if row["kind"] == kind]


def first_of(rows: list[dict], kind: str) -> dict | None:
    return next(iter(rows_of(rows, kind)), None)


if __name__ == "__main__":
    main()
