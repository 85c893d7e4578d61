"""Start-up: the image check (dataset/image_check.py, where there is no image store), not repeated by a restart or
resume for images that have not changed; under torchrun, the images decoded once, into the store, by one rank; and
the start-up benchmark's parts (tools/startup_benchmark.py)."""

import argparse
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

from dataset import images
from dataset.folders import list_images, read_split_data
from dataset.image_check import CHECKED_IMAGES, ImageCheck
from run.config import SINGLE, parse_config
from run.plan import prepare
from tools.startup_benchmark import image_counts, seconds_to_first_step, startup_benchmark, startup_table
from utils import UserError


def make_images(root, classes=("a", "b", "c"), per_class=4):
    """Small JPEGs, each different."""
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / name / f"{i}.jpg")
    return root


@pytest.fixture
def decoded(monkeypatch):
    """The images dataset.images.image_problem is asked about, in order (from any thread)."""
    asked, real = [], images.image_problem
    monkeypatch.setattr(images, "image_problem", lambda path: asked.append(path) or real(path))
    return asked


@pytest.mark.fast
def test_a_second_check_decodes_only_new_and_changed_images(tmp_path, decoded):
    data, run = make_images(tmp_path / "data"), tmp_path / "run"

    def check():
        decoded.clear()
        image_check = ImageCheck(data, run)
        split = read_split_data(data, verify_images=image_check)
        image_check.save(run)
        return split

    first = check()
    assert len(decoded) == 12 and first.unreadable == []
    assert check() == first and decoded == []  # nothing changed: nothing decoded, the same split

    changed, broken = data / "a" / "0.jpg", str(data / "b" / "broken.jpg")
    Image.new("RGB", (20, 20), "red").save(changed)  # another image under the same name
    Path(broken).write_bytes(changed.read_bytes()[:100])  # a corrupt image, added
    third = check()
    assert sorted(decoded) == sorted([str(changed), broken]) and third.unreadable == [broken]

    os.utime(changed, ns=(0, 10**18))  # the same bytes, touched: checked again (its key is size and time)
    (data / "c" / "3.jpg").unlink()
    fourth = check()
    assert decoded == [str(changed)] and third.unreadable == fourth.unreadable
    assert str(data / "c" / "3.jpg") not in fourth.train_images + fourth.val_images
    remembered = json.loads((run / CHECKED_IMAGES).read_text())["images"]
    assert sorted(remembered) == sorted(f"{p.parent.name}/{p.name}" for c in "abc" for p in list_images(data / c))
    assert remembered["b/broken.jpg"][2].startswith(("OSError", "UnidentifiedImageError", "SyntaxError"))


@pytest.mark.fast
def test_a_record_that_cannot_be_read_or_a_vanished_image_costs_a_decode_not_a_wrong_verdict(tmp_path, decoded):
    data, run = make_images(tmp_path / "data", classes=("a",)), tmp_path / "run"
    run.mkdir()
    (run / CHECKED_IMAGES).write_text('{"format": 1, "images": {"a/0.jpg": [1, 2, nu')  # cut short
    images = [str(image) for image in list_images(data / "a")]
    os.unlink(images[1])  # deleted between listing and checking
    assert ImageCheck(data, run)(images) == [images[1]]  # reported, as decoding it would have
    assert len(decoded) == 3


@pytest.mark.fast
def test_ranks_checking_at_once_decode_each_image_once_and_each_report_the_unreadable(tmp_path, decoded, monkeypatch):
    """What torchrun's ranks do before their process group exists (in threads here: the lock is the operating
    system's, per open file, so it keeps two threads apart as it keeps two processes)."""
    data, run = make_images(tmp_path / "data"), tmp_path / "run"
    (data / "c" / "broken.jpg").write_text("not an image")
    slow = images.image_problem
    monkeypatch.setattr(images, "image_problem", lambda path: threading.Event().wait(0.01) or slow(path))
    start, found = threading.Barrier(3), []

    def rank():
        start.wait()
        found.append(read_split_data(data, verify_images=ImageCheck(data, run, shared=True)).unreadable)

    ranks = [threading.Thread(target=rank) for _ in range(3)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert Counter(decoded) == Counter(str(image) for c in "abc" for image in list_images(data / c))
    assert found == [[str(data / "c" / "broken.jpg")]] * 3


@pytest.mark.fast
def test_a_restarted_run_decodes_nothing_and_reports_a_corrupt_image_added_since(tmp_path, decoded):
    data, run = make_images(tmp_path / "data", per_class=8), tmp_path / "run"
    flags = ["--data-path", data, "--output-dir", run, "--batch-size", "2", "--auto-resume", "--store-dir", "off"]

    def start(*more):
        decoded.clear()
        return prepare(parse_config(SINGLE, "", [str(flag) for flag in [*flags, *more]]), world_size=1)[1]

    first = start()
    assert len(decoded) == 24 and (run / CHECKED_IMAGES).exists()
    assert start().split == first.split and decoded == []  # a restart (before its first checkpoint)
    (data / "b" / "cut.jpg").write_bytes((data / "b" / "0.jpg").read_bytes()[:50])
    assert start().split.unreadable == [str(data / "b" / "cut.jpg")] == decoded
    with pytest.raises(UserError, match=r"1 unreadable image\(s\) \(--strict-images\): .*cut\.jpg"):
        start("--strict-images")
    assert decoded == []  # its verdict was remembered


def test_under_torchrun_the_images_are_decoded_once_into_the_store_by_one_rank_and_never_again(torchrun_run, tiny_data):
    """The run's two ranks meet at the image store: one builds it (each image decoded once, by its processes), the
    other waits and maps it; no epoch decodes an image, and no image check is needed besides."""
    result, out = torchrun_run  # 2 processes, each logging the images decoded for it (DECODE_LOG)
    logs = sorted((out.parent / "decodes").glob("*.log"))
    decoded = Counter(line for log in logs for line in log.read_text().splitlines())
    images = [str(image) for folder in sorted(tiny_data.iterdir()) for image in list_images(folder)]
    assert len(images) == 60 and decoded == Counter(images), result.stdout  # 48x40: one decode size for both
    assert len(logs) == 1  # one rank built the store; the other mapped it
    assert len(list((out.parent / "stores").glob("*.store"))) == 1 and not (out / CHECKED_IMAGES).exists()
    built, waited = f"Images: 60 decoded once into the store {out.parent / 'stores'}", "Images: 60 from the store"
    assert (built in result.stdout) != (waited in result.stdout)  # rank 0 says which it did


def test_the_startup_benchmark_at_a_hundred_images_builds_the_store_once_and_maps_it_in_the_second_run(tmp_path):
    assert image_counts("5000,20000") == [5000, 20000]
    with pytest.raises(argparse.ArgumentTypeError):
        image_counts("10")
    startup_benchmark([100], tmp_path / "out", "cpu", folders=tmp_path)
    [row] = json.loads((tmp_path / "out" / "startup.json").read_text())["rows"]
    logs = tmp_path / "out" / "logs"
    assert "decoded once into the store" in (logs / "startup-100-first.log").read_text()
    assert f"Images: {row['images']} from the store" in (logs / "startup-100-second.log").read_text()
    assert "(--store-dir off)" in (logs / "startup-100-off.log").read_text()
    assert 95 <= row["images"] <= 105 and row["store_gb"] > 0 and row["build_share"] > 0 and row["rss_anon_mb"] > 0
    assert startup_table([row]).splitlines()[2].startswith(f"| {row['images']} | ")


@pytest.mark.fast
def test_the_time_to_the_first_step_stops_at_the_progress_bar_and_kills_the_run(tmp_path):
    bar_then_wait = "import time; print('loading'); print('[epoch 0] train:   0%', flush=True); time.sleep(60)"
    seconds, memory = seconds_to_first_step([sys.executable, "-c", bar_then_wait], tmp_path / "log")
    assert 0 < seconds < 30 and memory > 0 and "[epoch 0] train" in (tmp_path / "log").read_text()
    with pytest.raises(UserError, match="ended before its first step"):
        seconds_to_first_step([sys.executable, "-c", "print('no step')"], tmp_path / "log")


@pytest.mark.fast
def test_a_scripts_process_freezes_its_objects_at_exit_once_however_often_main_ran():
    # gc.freeze counted; the first handler registered runs last: it sees what utils.entry_point left for the exit.
    code = (
        "import atexit, gc\n"
        "calls, freeze = [], gc.freeze\n"
        "gc.freeze = lambda: calls.append(1) or freeze()\n"
        "atexit.register(lambda: print(len(calls), gc.get_freeze_count() > 0))\n"
        "from utils import entry_point\n"
        "main = entry_point(lambda: print(len(calls)))\n"
        "main()\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["0", "0", "1", "True"], result.stderr  # at the exit alone, once
