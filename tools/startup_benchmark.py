"""Start-up against the size of the data (tools/benchmark.py --startup-sizes 1000,10000,100000): for each size, the
seconds until train_single_gpu.py's first step, cold and restarted, and the parts that grow with the data.
docs/performance.md ("Start-up") says what each column measures.
"""

import argparse
import datetime
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from dataset.folders import read_split_data, split_fingerprint
from dataset.image_check import CHECKED_IMAGES, ImageCheck
from dataset.in_memory import decode_here, decode_once
from dataset.transforms import train_transform, val_transform
from machine import cores_per_process, describe_cpu
from multi_train_utils.distributed_utils import Process, wait_for_all
from multi_train_utils.spawn_utils import find_free_port
from my_dataset import MyDataSet
from utils import UserError, write_json

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(tempfile.gettempdir()) / "benchmark_startup"
CLASSES = 10
FIRST_STEP = b"[epoch 0] train"  # train_one_epoch's progress bar, shown as its loop asks for the first batch
# Every choice given, so that auto does not measure: its measuring is a cost of the machine, not of the data
IMG_SIZE = 32
FLAGS = ["--img-size", str(IMG_SIZE), "--batch-size", "8", "--epochs", "1", "--workers", "0", "--amp", "off",
         "--no-channels-last"]  # fmt: skip
COLUMNS = {  # a row's key: the table's heading, the figure's format
    "images": ("images", ","), "first_step_cold_s": ("to first step, cold (s)", ".1f"),
    "first_step_warm_s": ("warm (s)", ".1f"), "listing_s": ("listing (s)", ".2f"),
    "check_cold_s": ("check, cold (s)", ".2f"), "check_warm_s": ("check, warm (s)", ".2f"),
    "split_fingerprint_s": ("split_fingerprint (s)", ".2f"), "decode_once_s": ("decode once (s)", ".2f"),
    "decoded_gb": ("decoded (GB)", ".2f"), "decode_2_each_s": ("2 processes: each decodes (s)", ".2f"),
    "decode_2_shared_s": ("2 processes: decoded once (s)", ".2f"),
    "checked_images_mb": ("checked_images.json (MB)", ".1f"), "split_pickled_mb": ("split pickled (MB)", ".1f"),
}  # fmt: skip


def image_counts(text: str) -> list[int]:
    """argparse type: "1000,10000,100000" as [1000, 10000, 100000], each at least 100."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: give image counts of at least 100, separated by commas")
    return counts


def startup_benchmark(counts: list[int], output_dir: Path, device: str) -> None:
    """Measure start-up at each of `counts` images; print the table and write `output_dir`/startup.json."""
    if (output_dir / "startup.json").exists():
        raise UserError(f"{output_dir} already holds a start-up benchmark: choose another --output-dir or remove it")
    machine = f"{describe_cpu()}; {device}"
    print(f"Start-up benchmark: train_single_gpu.py {' '.join(FLAGS)} --device {device}\nMachine: {machine}")
    rows = []
    for count in counts:
        data = small_images(DATA / f"{count}_images_32px", count)
        row = {"images": count, **startup_parts(data), **decoding_in_two_processes(data)}
        run = output_dir / "startup-runs" / str(count)
        command = [sys.executable, str(ROOT / "train_single_gpu.py"), "--data-path", str(data), *FLAGS,
                   "--device", device, "--output-dir", str(run)]  # fmt: skip
        row["first_step_cold_s"] = seconds_to_first_step(command, output_dir / "logs" / f"startup-{count}-cold.log")
        written = (run / CHECKED_IMAGES).stat().st_mtime_ns
        command.append("--auto-resume")
        row["first_step_warm_s"] = seconds_to_first_step(command, output_dir / "logs" / f"startup-{count}-warm.log")
        assert (run / CHECKED_IMAGES).stat().st_mtime_ns == written, "the restart decoded images"
        rows.append(row)
        print(f"  {count} images: {row['first_step_cold_s']:.1f} s cold, {row['first_step_warm_s']:.1f} s warm")
    record = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    write_json(output_dir / "startup.json", {**record, "flags": FLAGS, "rows": rows})
    print("\n" + startup_table(rows) + f"\n\nWrote {output_dir / 'startup.json'}")


def small_images(folder: Path, count: int) -> Path:
    """`folder`, holding `count` 32x32 JPEGs in CLASSES class folders, made whole the first time."""
    if folder.exists():
        return folder
    print(f"  generating {count} images into {folder} (once)", flush=True)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    rng = np.random.default_rng(count)
    colours = rng.integers(40, 216, size=(CLASSES, 1, 1, 3))
    for label in range(CLASSES):
        (partial / f"class{label:02d}").mkdir(parents=True)
    for i in range(count):
        label = i % CLASSES
        pixels = np.clip(colours[label] + rng.integers(-40, 41, size=(32, 32, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(partial / f"class{label:02d}" / f"{i:07d}.jpg", quality=90)
    partial.rename(folder)
    return folder


def startup_parts(data: Path) -> dict:
    """The parts of start-up that grow with the data, each timed once in this process."""
    with tempfile.TemporaryDirectory() as run:
        listing, _ = timed(read_split_data, data)
        cold_check = ImageCheck(data, Path(run))
        cold, split = timed(read_split_data, data, verify_images=cold_check)
        cold_check.save(Path(run))
        warm_check = ImageCheck(data, Path(run))
        warm, _ = timed(read_split_data, data, verify_images=warm_check)
        assert cold_check.decoded == len(split.train_images) + len(split.val_images) and warm_check.decoded == 0
        fingerprint, _ = timed(split_fingerprint, split, data)
        sets = training_sets(split, IMG_SIZE)
        decoding, line = timed(decode_once, sets, None)
        if any(data.decoded is None for data in sets):
            raise UserError(f"the start-up benchmark's images were not decoded into memory: {line}")
        return {
            "listing_s": listing, "check_cold_s": cold, "check_warm_s": warm, "split_fingerprint_s": fingerprint,
            "decode_once_s": decoding, "decoded_gb": sum(data.decoded.pixels.numel() for data in sets) / 1e9,
            "checked_images_mb": (Path(run) / CHECKED_IMAGES).stat().st_size / 1e6,
            "split_pickled_mb": len(pickle.dumps(split)) / 1e6,
        }  # fmt: skip


def decoding_in_two_processes(data: Path, img_size: int = IMG_SIZE) -> dict:
    """Seconds until two processes of a gloo group both hold every image of `data` decoded, each decoding all of them
    on its half of the cores (decode_here), and the first decoding them for both (decode_once)."""
    with tempfile.TemporaryDirectory() as folder:
        where = (find_free_port(), data, img_size, Path(folder))
        mp.start_processes(decode_in_rank, args=where, nprocs=2, start_method="spawn")
        seconds = [json.loads((Path(folder) / f"{rank}.json").read_text()) for rank in range(2)]
    return {key: max(rank[key] for rank in seconds) for key in ("decode_2_each_s", "decode_2_shared_s")}


def decode_in_rank(rank: int, port: int, data: Path, img_size: int, folder: Path) -> None:
    """Process `rank` of decoding_in_two_processes: its seconds, each way, to folder/<rank>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        split = read_split_data(data)

        def decoded(decode, *args) -> float:
            sets = training_sets(split, img_size)
            wait_for_all()
            seconds, _ = timed(lambda: (decode(sets, None, *args), wait_for_all()))
            assert all(data.decoded is not None for data in sets), "the images were not decoded into memory"
            return seconds

        each = decoded(decode_here, 2, cores_per_process(2))
        shared = decoded(decode_once, Process(rank, 2, rank, 2))
        write_json(folder / f"{rank}.json", {"decode_2_each_s": each, "decode_2_shared_s": shared})
    finally:
        dist.destroy_process_group()


def training_sets(split, img_size: int) -> list[MyDataSet]:
    return [MyDataSet(split.train_images, split.train_labels, train_transform(img_size)),
            MyDataSet(split.val_images, split.val_labels, val_transform(img_size))]  # fmt: skip


def timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


def seconds_to_first_step(command: list[str], log: Path) -> float:
    """Seconds from starting `command` until it prints FIRST_STEP; then it is killed, its output in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    output = b""
    try:
        while FIRST_STEP not in output:
            chunk = process.stdout.read1(65536)
            if not chunk:
                process.wait()
                status = process.returncode
                raise UserError(f"{command[1]} ended before its first step (exit status {status}); see {log}")
            output += chunk
        return time.perf_counter() - start
    finally:
        process.kill()
        process.wait()
        log.write_bytes(output)


def startup_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(heading for heading, _ in COLUMNS.values()) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{row[key]:{form}}" for key, (_, form) in COLUMNS.items()) + " |" for row in rows]
    return "\n".join(lines)
