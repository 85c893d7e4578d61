"""Start-up against the size of the data (tools/benchmark.py --startup-sizes 5000,20000): for each size, the seconds
to train_single_gpu.py's first step with the image store built, then mapped, then off. docs/performance.md
("Start-up") says what each column measures."""

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dataset.demo import FLOWER_PHOTOS, make_demo_data
from dataset.folders import read_split_data, split_fingerprint
from dataset.images import decoded_size, load_rgb
from dataset.transforms import decode_sides
from machine import available_cores, describe_cpu
from run.config import Config
from utils import UserError, write_json

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(tempfile.gettempdir()) / "benchmark_startup"
FIRST_STEP = b"[epoch 0] train"  # train_one_epoch's progress bar, shown as its loop asks for the first batch
# Every choice given, so that auto does not measure: its measuring is a cost of the machine, not of the data
FLAGS = ["--batch-size", "32", "--epochs", "1", "--workers", "0", "--amp", "off", "--no-channels-last"]
SAMPLE = 200  # images decoded in this process, on one core, for the cores' summed rate
COLUMNS = {  # a row's key: the table's heading, the figure's format
    "images": ("images", ","), "first_run_s": ("first run: to first step (s)", ".1f"),
    "second_run_s": ("second run (s)", ".1f"), "no_store_s": ("--store-dir off (s)", ".1f"),
    "build_s": ("store built (s)", ".1f"), "build_share": ("build rate / cores' decode rate", ".2f"),
    "store_gb": ("store (GB)", ".2f"), "rss_anon_mb": ("second run's own memory (MB)", ".0f"),
    "listing_s": ("listing (s)", ".2f"), "split_fingerprint_s": ("split_fingerprint (s)", ".2f"),
}  # fmt: skip


def image_counts(text: str) -> list[int]:
    """argparse type: "5000,20000" as [5000, 20000], each at least 100."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: give image counts of at least 100, separated by commas")
    return counts


def startup_benchmark(counts: list[int], output_dir: Path, device: str, folders: Path = DATA) -> None:
    """Measure start-up at each of `counts` images (their folders made once in `folders`) into startup.json."""
    if (output_dir / "startup.json").exists():
        raise UserError(f"{output_dir} already holds a start-up benchmark: choose another --output-dir or remove it")
    machine, logs, rows = f"{describe_cpu()}; {device}", output_dir / "logs", []
    print(f"Start-up benchmark: train_single_gpu.py {' '.join(FLAGS)} --device {device}\nMachine: {machine}")
    for count in counts:
        data, scale = folders / f"{count}_photos", count / sum(FLOWER_PHOTOS.values())
        classes = {kind: max(1, round(n * scale)) for kind, n in FLOWER_PHOTOS.items()}  # flower_photos' proportions
        if not data.exists():
            print(f"  generating {sum(classes.values())} photo-like JPEGs into {data} (once)", flush=True)
        make_demo_data(data, classes, photo_like=True, workers=available_cores())
        stores, runs = output_dir / "startup-stores" / str(count), output_dir / "startup-runs" / str(count)
        shutil.rmtree(stores, ignore_errors=True)  # the first run builds it
        env = {"FLOWERS_STORE_DIR": str(stores)}
        command = [sys.executable, str(ROOT / "train_single_gpu.py"), "--data-path", str(data), *FLAGS, "--device",
                   device, "--output-dir"]  # fmt: skip
        first_log = logs / f"startup-{count}-first.log"
        first, _ = seconds_to_first_step([*command, runs / "first"], first_log, env)
        second, memory = seconds_to_first_step([*command, runs / "second"], logs / f"startup-{count}-second.log", env)
        off = [*command, runs / "off", "--store-dir", "off"]
        no_store, _ = seconds_to_first_step(off, logs / f"startup-{count}-off.log")
        built = re.search(r"\(([\d.]+) GB[^)]*?, ([\d.]+) s, (\d+) processes\)", first_log.read_text())
        if built is None:
            raise UserError(f"the first run did not build the image store: see {first_log}")
        listing, split = timed(read_split_data, data)  # the parts of every start that grow with the data
        fingerprint, _ = timed(split_fingerprint, split, data)
        row = {"images": len(split.train_images) + len(split.val_images), "listing_s": listing,
               "split_fingerprint_s": fingerprint, "first_run_s": first, "second_run_s": second, "no_store_s": no_store,
               "build_s": float(built[2]), "store_gb": float(built[1]), "rss_anon_mb": memory}  # fmt: skip
        row["build_share"] = row["images"] / row["build_s"] * decode_seconds(data) / int(built[3])  # of the cores' rate
        rows.append(row)
        print(f"  {row['images']} images: first run {first:.1f} s, second {second:.1f} s, no store {no_store:.1f} s")
    write_json(output_dir / "startup.json", {"machine": machine, "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "flags": FLAGS, "rows": rows})  # fmt: skip
    print("\n" + startup_table(rows))
    print(f"\nWrote {output_dir / 'startup.json'}")


def decode_seconds(data: Path) -> float:
    """Seconds one core takes to decode an image of `data` as the store does (once for each shape it takes at a run's
    decode sizes), over SAMPLE images (PIL decodes in the thread that asks)."""
    split, sides = read_split_data(data), decode_sides(Config.default("img_size"))
    paths = (split.train_images + split.val_images)[:SAMPLE]
    start = time.perf_counter()
    for path in paths:
        shapes = {decoded_size(path, side): side for side in reversed(sides)}  # (the store decodes each once)
        for side in shapes.values():
            load_rgb(path, side).tobytes()
    return (time.perf_counter() - start) / len(paths)


def timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


def seconds_to_first_step(command: list[str], log: Path, env: dict | None = None) -> tuple[float, float | None]:
    """(seconds from starting `command` until it prints FIRST_STEP, the MB of its own memory then: RssAnon, None
    where the system does not say); then it is killed, its output in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip
    output = b""
    try:
        while FIRST_STEP not in output:
            chunk = process.stdout.read1(65536)
            if not chunk:
                raise UserError(f"{command[1]} ended before its first step (exit status {process.wait()}); see {log}")
            output += chunk
        seconds = time.perf_counter() - start
        try:  # RssAnon: not the files it maps, such as the image store
            found = re.search(r"RssAnon:\s+(\d+) kB", Path(f"/proc/{process.pid}/status").read_text())
        except OSError:
            found = None
        return seconds, None if found is None else int(found[1]) / 1024
    finally:
        process.kill()
        process.wait()
        log.write_bytes(output)


def startup_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(heading for heading, _ in COLUMNS.values()) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{row[key]:{form}}" for key, (_, form) in COLUMNS.items()) + " |" for row in rows]
    return "\n".join(lines)
