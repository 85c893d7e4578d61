"""The benchmark's rows that run the scripts as a user does, each in a new interpreter: train_single_gpu.py (auto,
baseline, fixed, paths, profile), the two DDP scripts, the demo and predict.py."""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from autotune.remembered import cache_file, read_entries
from machine import available_cores
from multi_train_utils.train_eval_utils import Choice
from run.config import DEMO_DEFAULTS
from tools.compute_peak import described, row, trained_row, worker_phrase
from tools.profile_steps import SUMMARY_NAME, printed
from utils import UserError, writing

ROOT = Path(__file__).resolve().parents[1]
SINGLE = [str(ROOT / "train_single_gpu.py")]
# The fixed configurations auto is compared with: --amp, channels_last
FIXED = {"float32-nchw": ("off", False), "float32-channels_last": ("off", True), "bf16-nchw": ("bf16", False),
         "bf16-channels_last": ("bf16", True)}  # fmt: skip


def auto_run(args) -> tuple[dict, Choice]:
    """train_single_gpu.py's first run here, auto measuring: its figures (and measure_seconds) and what auto chose."""
    measured = run_script(args, "auto", SINGLE, [])
    measured["measure_seconds"] = measuring_seconds(args.img_size, args.batch_size)
    log = (args.output_dir / "logs" / "auto.log").read_text()
    workers = int(re.search(r"(\d+) loader workers per process", log).group(1))
    return measured, replace(chosen(args, "auto"), workers=workers)


def chosen(args, name: str) -> Choice:
    """How the run `name` computed, as its args.json records (a DDP run may choose otherwise than auto's row)."""
    record = json.loads((args.output_dir / "runs" / name / "args.json").read_text())
    return Choice(record["amp"], record["channels_last"], record["micro_batch"], record["batches"])


def measuring_seconds(img_size: int, batch_size: int) -> float | None:
    """What auto's measuring took in the first single-process run at this size; None if it measured nothing."""
    for entry in read_entries(cache_file()):
        key = entry.get("key", {})
        if (key.get("img_size"), key.get("batch_size"), key.get("processes_here")) == (img_size, batch_size, 1):
            return entry["choice"]["seconds"]
    return None


# The paths' rows: each batch path forced (stream: the images in no device memory, each batch gathered from the store)
PATHS = {"device": ["--batches", "device"], "loader": ["--batches", "loader"],
         "stream": ["--batches", "device", "--device-images-gb", "0"]}  # fmt: skip


def script_rows(args, choice: Choice, nprocs: int, peaks: dict, flops: float):
    """The scripts end to end but auto's first run, in this order: later, profile, baseline, fixed, paths, DDP with
    `nprocs` processes, demo."""
    if "later" in args.rows:  # as the auto row ran, auto's choice now remembered, as later runs find it
        measured = run_script(args, "later", SINGLE, [])
        name = "train_single_gpu.py, auto, a later run (the choice remembered)"
        yield trained_row(name, "later", 1, chosen(args, "later"), measured, peaks, flops)
    if "profile" in args.rows:  # as auto chose, its second epoch's first --profile-steps steps traced (img/s: theirs)
        tracer = [str(ROOT / "tools" / "profile_steps.py"), "--epoch", "1", "--steps", str(args.profile_steps)]
        tracer += ["--trace-dir", str(args.output_dir), *SINGLE]
        measured = run_script(args, "profile", tracer, [*choice_flags(choice), "--epochs", "2"])
        found = json.loads((args.output_dir / SUMMARY_NAME).read_text())
        print(printed(found), flush=True)
        found["img_per_sec"] = found["traced_steps"] * args.batch_size / found["traced_seconds"]
        feeding = "batches made on the device" if choice.on_device else worker_phrase(choice.workers)
        found["workers"] = choice.workers
        found |= {key: value for key, value in measured.items() if key.startswith("peak_")}
        yield row(f"profile: train_one_epoch, {feeding}", "profile", 1, described(choice), found)
    if "baseline" in args.rows:
        original = Choice(workers=min(os.cpu_count() or 1, args.batch_size, 8))  # float32, NCHW, its num_workers
        measured = run_script(args, "baseline", SINGLE, [*choice_flags(original), "--no-persistent-workers"])
        yield trained_row("baseline: the original's setup", "baseline", 1, original, measured, peaks, flops)
    for name in args.fixed:
        amp, channels_last = FIXED[name]
        fixed = replace(choice, amp=amp, channels_last=channels_last, micro_batch=None)  # fed as auto chose
        measured = run_script(args, f"fixed-{name}", SINGLE, choice_flags(fixed))
        yield trained_row(f"fixed: {fixed.name()}", "fixed", 1, fixed, measured, peaks, flops)
    for path, where in PATHS.items() if "paths" in args.rows else ():
        if path == choice.batches:  # auto's row
            continue
        try:
            measured = run_script(args, f"batches-{path}", SINGLE, [*precision_flags(choice), *where])
        except UserError as failed:
            print(f"  --batches {path}: left out ({failed})", flush=True)
            continue
        name = f"train_single_gpu.py, {' '.join(where)}"
        yield trained_row(name, "paths", 1, chosen(args, f"batches-{path}"), measured, peaks, flops)
    launches = {"torchrun": ([*torchrun(nprocs), str(ROOT / "train_multi_gpu_using_launch.py")], []),
                "spawn": ([str(ROOT / "train_multi_gpu_using_spawn.py")], ["--world-size", str(nprocs)])}  # fmt: skip
    for kind, (script, flags) in launches.items():
        if kind in args.rows:
            measured = run_script(args, kind, script, flags)
            yield trained_row(f"{kind}, {nprocs} processes", kind, nprocs, chosen(args, kind), measured, peaks, flops)
    if "demo" in args.rows:
        demo = run_script(args, "demo", SINGLE, [], demo=True)
        demo["measure_seconds"] = measuring_seconds(DEMO_DEFAULTS["img_size"], DEMO_DEFAULTS["batch_size"])
        yield row("train_single_gpu.py --demo, its first run", "demo", 1, described(chosen(args, "demo")), demo)


def timm_rows(args, choice: Choice, split, peaks: dict, flops: float):
    """timm's train.py (--timm-train PATH) on the scripts' split, with its fastest flags here."""
    if "timm" not in args.rows:
        return
    if args.timm_train is None:
        print("  timm's train.py: left out (--timm-train PATH names it, a pytorch-image-models checkout's)", flush=True)
        return
    data, cores = args.output_dir / "timm_data", available_cores()
    parts = {"train": (split.train_images, split.train_labels), "validation": (split.val_images, split.val_labels)}
    for part, (images, labels) in parts.items():  # links to the split's images, in the folders timm reads
        for number, (image, label) in enumerate(zip(images, labels, strict=True)):
            link = data / part / split.classes[label] / f"{number}{Path(image).suffix}"
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(image).resolve())
    flags = ["--model", args.model.removeprefix("timm/"), "--num-classes", str(len(split.classes))]
    flags += ["--img-size", str(args.img_size), "-b", str(args.batch_size), "--epochs", str(args.epochs)]
    flags += ["-j", str(cores), "--pin-mem", "--device", args.device, "--log-interval", "1000000"]
    flags += ["--amp", "--amp-dtype", "bfloat16"] if choice.amp == "bf16" else []
    flags += ["--channels-last"] if choice.channels_last else []
    flags += ["--output", str(args.output_dir / "runs"), "--experiment", "timm"]
    wall = logged_run(args, "timm", [sys.executable, str(args.timm_train), str(data), *flags])
    rates = timm_rates((args.output_dir / "logs" / "timm.log").read_text(), args.epochs)
    measured = {"img_per_sec": sum(rates[1:]) / len(rates[1:]), "epoch_img_per_sec": rates, "run_seconds": wall}
    name = f"timm's train.py: {worker_phrase(cores)}, pinned"
    yield trained_row(name, "timm", 1, replace(choice, micro_batch=None, workers=cores), measured, peaks, flops)


def timm_rates(log: str, epochs: int) -> list[float]:
    """Each epoch's images per second from timm's train.py's log: its average rate on the epoch's last step."""
    last = {}
    for epoch, done, total, rate in re.findall(r"Train: (\d+) \[\s*(\d+)/(\d+).*?\([\d.]+s,\s*([\d.]+)/s\)", log):
        if int(done) == int(total) - 1:
            last[int(epoch)] = float(rate)
    if sorted(last) != list(range(epochs)):
        raise UserError(f"timm's train.py logged no rate for some of its {epochs} epochs; see its log")
    return [last[epoch] for epoch in range(epochs)]


def choice_flags(choice: Choice) -> list[str]:
    flags = [*precision_flags(choice), "--workers", str(choice.workers), "--batches", choice.batches]
    return flags + (["--micro-batch", str(choice.micro_batch)] if choice.micro_batch else [])


def precision_flags(choice: Choice) -> list[str]:
    return ["--amp", choice.amp, "--channels-last" if choice.channels_last else "--no-channels-last"]


def torchrun(nprocs: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]


def settings_flags(args) -> list[str]:
    return ["--model", args.model, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size)]


def run_script(args, name: str, script: list, flags: list, demo: bool = False) -> dict:
    """Train with `script` (what follows `python`) on the benchmark's data, or as --demo does; its figures."""
    out = args.output_dir / "runs" / name
    command = [sys.executable, *script, "--output-dir", str(out), "--device", args.device]
    if not demo:
        command += [*settings_flags(args), "--data-path", str(args.data_path), "--epochs", str(args.epochs)]
    command += [*flags, "--demo"] if demo else flags
    wall = logged_run(args, name, command)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = epochs[1:]  # averaged over the epochs after the first
    return {
        "img_per_sec": sum(m["train_images_per_sec"] for m in steady) / len(steady),
        "epoch_seconds": sum(m["epoch_seconds"] for m in steady) / len(steady),
        "first_epoch_seconds": epochs[0]["epoch_seconds"], "run_seconds": wall, "val_acc": epochs[-1]["val_acc"],
        "peak_rss_mib": max((m["peak_rss_mib"] for m in epochs if "peak_rss_mib" in m), default=None),
        **({"peak_gpu_mib": max(m["peak_gpu_mib"] for m in epochs)} if "peak_gpu_mib" in epochs[0] else {}),
    }  # fmt: skip


def logged_run(args, name: str, command: list) -> float:
    """Run `command`, its output to --output-dir/logs/NAME.log; its wall seconds."""
    log = args.output_dir / "logs" / f"{name}.log"
    with writing(log):
        log.parent.mkdir(parents=True, exist_ok=True)
        log.touch()  # (the script writes into it)
    print(f"  {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise UserError(f"{name} failed (exit status {result.returncode}); see {log}")
    return time.perf_counter() - start


def predict_rows(args, nprocs: int, measured: list[dict]):
    """predict.py with auto's weights, in one process and in `nprocs` under torchrun, beside the model-only ceiling."""
    if "predict" not in args.rows:
        return
    ceiling = next((row["img_per_sec"] for row in measured if row["kind"] == "model-only"), None)
    for processes, launcher in ((1, []), (nprocs, torchrun(nprocs))):
        name = f"predict.py, {processes} process{'es' * (processes > 1)}" + (", torchrun" if launcher else "")
        figures = run_predict(args, f"predict-{processes}", [*launcher, str(ROOT / "predict.py")])
        figures["training_step_img_per_sec"] = ceiling
        yield row(name, "predict", processes, described(chosen(args, "auto")), figures)


def run_predict(args, name: str, script: list) -> dict:
    """predict.py (`script`: what follows `python`) with auto's best weights; its speed from its last line."""
    runs, log = args.output_dir / "runs", args.output_dir / "logs" / f"{name}.log"
    command = [sys.executable, *script, str(args.data_path), "--weights", str(runs / "auto" / "weights" / "best.pth")]
    wall = logged_run(args, name, [*command, "--results", str(runs / f"{name}.csv"), "--device", args.device])
    speed = re.search(r"\(([\d.]+) images/s", log.read_text())
    if speed is None:
        raise UserError(f"{name} did not say its speed; see {log}")
    return {"img_per_sec": float(speed[1]), "run_seconds": wall}
