"""Start-up against the size of the data (tools/benchmark.py --startup-sizes 5000,20000): for each size, a folder of
photo-like JPEGs, and the seconds until train_single_gpu.py's first step for a first run (which builds the image
store), a second run (which maps it) and a run without a store; the store's build rate against the cores' summed
decoding rate, its size, and the second run's own memory. docs/performance.md ("Start-up") says what each column
measures.
"""

import argparse
import datetime
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dataset.demo import FLOWER_PHOTOS, make_demo_data
from dataset.folders import read_split_data, split_fingerprint
from dataset.images import capped, decoded_size, load_rgb
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
    """Measure start-up at each of `counts` images (their folders made once in `folders`); print the table and
    write `output_dir`/startup.json."""
    if (output_dir / "startup.json").exists():
        raise UserError(f"{output_dir} already holds a start-up benchmark: choose another --output-dir or remove it")
    machine = f"{describe_cpu()}; {device}"
    print(f"Start-up benchmark: train_single_gpu.py {' '.join(FLAGS)} --device {device}\nMachine: {machine}")
    rows = []
    for count in counts:
        data = photo_like_images(folders / f"{count}_photos", count)
        stores = output_dir / "startup-stores" / str(count)
        shutil.rmtree(stores, ignore_errors=True)  # the first run builds it
        env = {"FLOWERS_STORE_DIR": str(stores)}

        logs = output_dir / "logs"
        runs = output_dir / "startup-runs" / str(count)
        command = [sys.executable, str(ROOT / "train_single_gpu.py"), "--data-path", str(data), *FLAGS, "--device",
                   device, "--output-dir"]  # fmt: skip
        first, _ = seconds_to_first_step([*command, runs / "first"], logs / f"startup-{count}-first.log", env)
        second, memory = seconds_to_first_step([*command, runs / "second"], logs / f"startup-{count}-second.log", env)
        off = [*command, runs / "off", "--store-dir", "off"]
        no_store, _ = seconds_to_first_step(off, logs / f"startup-{count}-off.log")
        built = re.search(
            r"\(([\d.]+) GB[^)]*?, ([\d.]+) s, (\d+) processes\)", (logs / f"startup-{count}-first.log").read_text()
        )
        if built is None:
            raise UserError(f"the first run did not build the image store: see {logs / f'startup-{count}-first.log'}")
        gigabytes, build, processes = float(built[1]), float(built[2]), int(built[3])
        row = {"images": count, **listing_parts(data), "first_run_s": first, "second_run_s": second,
               "no_store_s": no_store, "build_s": build, "store_gb": gigabytes, "rss_anon_mb": memory}  # fmt: skip
        row["build_share"] = row["images"] / build / (processes / decode_seconds(data))  # (the cores' summed rate)
        rows.append(row)
        print(f"  {row['images']} images: first run {first:.1f} s, second {second:.1f} s, no store {no_store:.1f} s")
    record = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    formats = store_formats(data)
    write_json(output_dir / "startup.json", {**record, "flags": FLAGS, "rows": rows, "formats": formats})
    print("\n" + startup_table(rows) + "\n\nThe store's formats, on one core, at the last size's images:")
    for row in formats:
        print(
            f"  {row['format']}: {row['kb_an_image']:.1f} KB an image, made in {row['build_ms']:.2f} ms, read back "
            f"in {row['read_ms']:.3f} ms"
        )
    print(f"\nWrote {output_dir / 'startup.json'}")


def photo_like_images(folder: Path, count: int) -> Path:
    """`folder`, holding about `count` photo-like JPEGs in flower_photos' classes and proportions, made once."""
    scale = count / sum(FLOWER_PHOTOS.values())
    counts = {kind: max(1, round(n * scale)) for kind, n in FLOWER_PHOTOS.items()}
    if not folder.exists():
        print(f"  generating {sum(counts.values())} photo-like JPEGs into {folder} (once)", flush=True)
    return make_demo_data(folder, counts, photo_like=True, workers=available_cores())


def decode_seconds(data: Path) -> float:
    """Seconds one core takes to decode an image of `data` as the store does (once for each shape it takes at a run's
    decode sizes), over SAMPLE images (PIL decodes in the thread that asks)."""
    paths, sides = sample_of(data), decode_sides(Config.default("img_size"))
    start = time.perf_counter()
    for path in paths:
        shapes = {decoded_size(path, side): side for side in reversed(sides)}  # (the store decodes each once)
        for side in shapes.values():
            load_rgb(path, side).tobytes()
    return (time.perf_counter() - start) / len(paths)


def sample_of(data: Path) -> list[str]:
    """The first SAMPLE images of `data`'s split."""
    split = read_split_data(data)
    return (split.train_images + split.val_images)[:SAMPLE]


def store_formats(data: Path, side: int = 256, quality: int = 90) -> list[dict]:
    """The store's candidate formats on SAMPLE images of `data`, each on one core: the bytes an image takes, the
    milliseconds to make it from its file (once, building the store) and to read it back as pixels (every epoch).
    Raw pixels as the store keeps them; JPEG re-encoded with its shorter side at most `side`; the files as they are."""
    paths, min_side = sample_of(data), decode_sides(Config.default("img_size"))[0]
    build, decoded = timed(lambda: [load_rgb(path, min_side) for path in paths])
    raw = [image.tobytes() for image in decoded]
    encode, jpegs = timed(lambda: [encoded(image, side, quality) for image in decoded])
    read_raw, _ = timed(lambda: [np.frombuffer(pixels, np.uint8).copy() for pixels in raw])
    read_jpeg, _ = timed(lambda: [Image.open(io.BytesIO(jpeg)).convert("RGB").tobytes() for jpeg in jpegs])
    milliseconds = 1000 / len(paths)
    files = [Path(path).read_bytes() for path in paths]
    rows = [("raw 8-bit pixels", raw, build, read_raw),
            (f"JPEG, shorter side {side}, quality {quality}", jpegs, build + encode, read_jpeg),
            ("the files as they are", files, 0, build)]  # fmt: skip
    return [{"format": name, "kb_an_image": sum(map(len, kept)) / len(kept) / 1000, "build_ms": made * milliseconds,
             "read_ms": read * milliseconds} for name, kept, made, read in rows]  # fmt: skip


def encoded(image, side: int, quality: int) -> bytes:
    """`image` as a JPEG of its shorter side at most `side`."""
    height, width = capped((image.height, image.width), side)
    out = io.BytesIO()
    image.resize((width, height), Image.Resampling.LANCZOS).save(out, "JPEG", quality=quality)
    return out.getvalue()


def listing_parts(data: Path) -> dict:
    """The images of `data`, and the parts of every start that grow with them: listing the folder, and
    fingerprinting its split."""
    listing, split = timed(read_split_data, data)
    fingerprint, _ = timed(split_fingerprint, split, data)
    images = len(split.train_images) + len(split.val_images)
    return {"images": images, "listing_s": listing, "split_fingerprint_s": fingerprint}


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
                process.wait()
                status = process.returncode
                raise UserError(f"{command[1]} ended before its first step (exit status {status}); see {log}")
            output += chunk
        return time.perf_counter() - start, own_memory(process.pid)
    finally:
        process.kill()
        process.wait()
        log.write_bytes(output)


def own_memory(pid: int) -> float | None:
    """MB of the process's own memory (RssAnon: not the files it maps, such as the image store)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"RssAnon:\s+(\d+) kB", status)
    return None if found is None else int(found[1]) / 1024


def startup_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(heading for heading, _ in COLUMNS.values()) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{row[key]:{form}}" for key, (_, form) in COLUMNS.items()) + " |" for row in rows]
    return "\n".join(lines)
