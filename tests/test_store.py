"""The image store (dataset/store.py): what it gives is what the files give, at each decode size; it is found by
its files and sizes, never stale, and a damaged one is built again; a build stopped by a kill goes on where it
stopped, one stopped by a full disk leaves nothing, and two builds at once are one build; loader workers started
by spawn map the file, they do not copy it. The stores are built in each test's own folder."""

import contextlib
import errno
import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image
from spawn_world import forkserver
from test_dataset import varied_images
from torch.utils.data import DataLoader, get_worker_info

import dataset.store as store_module
from dataset.folders import read_split_data
from dataset.images import SKIPPED, decoded_size, load_rgb
from dataset.store import Store, StoredImages, store_for
from dataset.transforms import train_transform, val_transform
from my_dataset import MyDataSet

SIDES = [train_transform(48).min_side, val_transform(48).min_side]  # (a run's at --img-size 48: 196 and 55)


def stored(paths: list, store: Store, transform) -> MyDataSet:
    data = MyDataSet(paths, list(range(len(paths))), transform)
    data.decoded = store.images([str(path) for path in paths], data.min_side)
    return data


def as_their_files(paths: list, store: Store) -> bool:
    """Whether each of `paths` from `store` is, for validation, what its file gives."""
    preset = val_transform(48)
    from_store, from_files = stored(paths, store, preset), MyDataSet(paths, list(range(len(paths))), preset)
    return all(torch.equal(from_store[i][0], from_files[i][0]) for i in range(len(paths)))


@pytest.mark.fast
@pytest.mark.parametrize("transform", ["train", "val"])
def test_images_from_the_store_give_exactly_the_items_their_files_give(tmp_path, transform, capsys):
    """A large JPEG (decoded at a reduced scale, a different one for training and validation: two entries), one
    stored sideways with an EXIF rotation, an RGBA and a 16-bit PNG, a small JPEG: each item from the store is the
    item from its file, bit for bit, under any seed; a file that is no image is listed unreadable."""
    paths = varied_images(tmp_path)
    store, line = store_for([str(path) for path in paths], tmp_path / "stores", SIDES)
    assert line.startswith("Images: 6 decoded once into the store") and store.unreadable() == [str(paths[-1])]
    large = store.shapes[0].tolist()  # the large JPEG at training's size and validation's: 1/4 and 1/8 scale
    assert large == [[300, 400], [150, 200]] and store.offsets[0, 0] != store.offsets[0, 1]
    assert store.offsets[4, 0] == store.offsets[4, 1]  # the small JPEG: one size for both, stored once
    preset = train_transform(48, "trivialaugment", 0.5) if transform == "train" else val_transform(48)
    from_files, from_store = MyDataSet(paths, list(range(6)), preset), stored(paths, store, preset)
    for index in range(len(paths)):
        for seed in (1, 2, 3):
            (expected, expected_label), (got, label) = from_files[(index, seed)], from_store[(index, seed)]
            assert expected.dtype == got.dtype == torch.uint8
            assert torch.equal(expected, got) and label == expected_label
    assert label == SKIPPED and "skipped unreadable image" in capsys.readouterr().err


@pytest.mark.fast
def test_a_store_is_found_by_its_files_and_decode_sizes_and_never_read_stale_or_damaged(tmp_path, capsys):
    bitmap = tmp_path / "bitmap.bmp"  # (uncompressed: changed, it keeps its size)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(bitmap)
    paths = [str(path) for path in varied_images(tmp_path)[:4]] + [str(bitmap)]
    folder = tmp_path / "stores"
    first, line = store_for(paths, folder, SIDES)
    again, line = store_for(paths, folder, SIDES)
    assert line == f"Images: 5 from the store {first.path}, decoded once by an earlier run" and again.path == first.path
    # A file changed (its modification time; here its pixels too, at the same size): another store
    size = os.path.getsize(bitmap)
    Image.open(bitmap).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(bitmap)
    assert os.path.getsize(bitmap) == size
    os.utime(paths[4], ns=(time.time_ns(), time.time_ns() + 10**9))
    changed, line = store_for(paths, folder, SIDES)
    assert "decoded once" in line and changed.path != first.path
    assert as_their_files(paths, changed)
    # Other decode sizes (another --img-size): another store
    other, line = store_for(paths, folder, [SIDES[0] * 2, SIDES[1]])
    assert "decoded once" in line and other.path not in (first.path, changed.path)
    # A damaged store (cut short, or not a store at all): one warning, built again, never read
    for damage in (lambda path: os.truncate(path, os.path.getsize(path) - 1), lambda path: path.write_bytes(b"x")):
        damage(changed.path)
        capsys.readouterr()
        rebuilt, line = store_for(paths, folder, SIDES)
        assert "decoded once" in line and capsys.readouterr().err.count(f"{changed.path} is damaged: built again") == 1
        assert as_their_files(paths, rebuilt)


def _build_until_killed(paths: list, folder, sides: list) -> None:
    """Build a store in one building process, which is killed (SIGKILL, by its own decoding process) as its third
    task starts, once the first two tasks' images are marked done in the partial file (write_then_kill)."""
    store_module.TASK_IMAGES = 2
    store_module.available_cores = lambda: 1
    write_then_kill.decode, write_then_kill.folder = store_module.write_decoded, folder
    write_then_kill.count = len(paths)
    store_module.write_decoded = write_then_kill
    store_for(paths, folder, sides)


def write_then_kill(task):
    write_then_kill.calls = getattr(write_then_kill, "calls", 0) + 1
    if write_then_kill.calls == 3:
        partial = next(write_then_kill.folder.glob(".*.partial"))
        while int((store_module.resumed(partial, write_then_kill.count) != store_module.STATE_TODO).sum()) < 4:
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)  # (ended with its pool when the building process is gone)
    return write_then_kill.decode(task)


def images_of(folder, count: int) -> list[str]:
    """`count` small distinct JPEGs in `folder`."""
    rng = np.random.default_rng(count)
    folder.mkdir(parents=True)
    for index in range(count):
        Image.fromarray(rng.integers(0, 255, (20 + index, 30, 3), dtype=np.uint8)).save(folder / f"{index:02d}.jpg")
    return sorted(str(path) for path in folder.iterdir())


def test_a_build_killed_half_way_leaves_a_partial_file_that_the_next_build_goes_on_from(tmp_path):
    paths, folder = images_of(tmp_path / "images", 10), tmp_path / "stores"
    killed = forkserver().Process(target=_build_until_killed, args=(paths, folder, SIDES))
    killed.start()
    killed.join(120)
    assert killed.exitcode == -signal.SIGKILL
    [partial] = folder.glob(".*.partial")
    assert list(folder.glob("*.store")) == []  # nothing a run would read
    store, line = store_for(paths, folder, SIDES)
    assert "4 of them decoded by an earlier build that was stopped" in line and not partial.exists()
    assert as_their_files(paths, store)


@pytest.mark.fast
def test_a_full_disk_leaves_no_partial_file_and_the_run_reads_its_images_from_their_files(tmp_path, monkeypatch):
    paths = [str(path) for path in varied_images(tmp_path)[:5]]
    folder = tmp_path / "stores"

    def no_room(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module.os, "posix_fallocate", no_room, raising=False)
    images = StoredImages(folder, SIDES, None, fallback=lambda images: ["checked by the fallback"])
    assert images(paths) == ["checked by the fallback"] and images.path is None
    assert images.line == (
        f"Images: decoded from their files every epoch: no image store could be made ({folder}: No space left on "
        "device)"
    )
    assert sorted(path.name for path in folder.iterdir()) == [f"{store_module.fingerprint(paths, SIDES)}.lock"]


@pytest.mark.fast
def test_where_the_disk_holds_less_than_the_decoded_images_they_are_stored_capped_and_the_line_says_so(
    tmp_path, monkeypatch
):
    paths = [str(path) for path in varied_images(tmp_path)[:5]]
    full = sum(3 * np.prod(size) for size in {tuple(decoded_size(path, side)) for path in paths for side in SIDES})
    usage = store_module.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda path: usage._replace(free=full // 2))
    store, line = store_for(paths, tmp_path / "stores", SIDES)
    cap = store.shapes.min(axis=2).max()  # the shorter sides: at most the cap
    assert f"capped at {cap} px on the shorter side to fit the disk ({full / 1e9:.1f} GB uncapped)" in line
    assert store.path.name.endswith(f"-{cap}.store") and os.path.getsize(store.path) < full // 2 * 0.9 + 10**5
    large = load_rgb(paths[0], SIDES[0])  # 400 x 300, stored at the cap
    assert tuple(store.shapes[0, 0]) == (cap, round(400 * cap / 300)) and large.size == (400, 300)


def _build_and_say(paths: list, folder, out, go=None) -> None:
    """store_for in a process of its own, what it prints to the file `out` as it prints it, then its line; `go`: a
    file whose making each of the build's decoding tasks waits for (slowly)."""
    if go is not None:
        slowly.decode, slowly.go, store_module.write_decoded = store_module.write_decoded, go, slowly
    with open(out, "w", buffering=1) as printed, contextlib.redirect_stdout(printed):
        _, line = store_for(paths, folder, SIDES)
        print(line)


def until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "waited a minute"
        time.sleep(0.01)


def slowly(task):
    while not slowly.go.exists():
        time.sleep(0.01)
    return slowly.decode(task)


def test_two_runs_building_one_store_at_once_make_one_build_and_the_second_maps_it(tmp_path):
    paths, folder = images_of(tmp_path / "images", 6), tmp_path / "stores"
    built, waited, go = (tmp_path / name for name in ("first.txt", "second.txt", "go"))
    first = forkserver().Process(target=_build_and_say, args=(paths, folder, built, go))
    first.start()
    second = forkserver().Process(target=_build_and_say, args=(paths, folder, waited))
    try:
        until(lambda: list(folder.glob(".*.partial")))  # the first holds the lock, and is building
        second.start()
        until(lambda: waited.exists() and "waiting" in waited.read_text())
    finally:
        go.touch()  # the first's build goes on (where the second did not wait too: no process left waiting)
    for process in (first, second):
        process.join(120)
        assert process.exitcode == 0
    assert "decoded once into the store" in built.read_text()
    assert "waiting for another process building the store" in waited.read_text()
    assert "from the store" in waited.read_text() and len(list(folder.glob("*.store"))) == 1


def mapped_or_fail(worker: int) -> None:
    decoded = get_worker_info().dataset.decoded
    path = str(decoded.mapped[0])
    with open("/proc/self/maps") as maps:
        if path not in maps.read():
            raise AssertionError(f"loader worker {worker} holds a copy of the store, not a map of {path}")


def test_loader_workers_started_by_spawn_map_the_store_and_load_the_same_batches(tmp_path):
    """As on Windows and macOS: a worker started by spawn gets the store's images as the file to map (a few
    hundred bytes pickled), not their pixels, and loads the same batches as the process itself does. Started here
    by the forkserver, which hands a worker its dataset as spawn does (pickled)."""
    paths = [str(path) for path in varied_images(tmp_path)[:5]]
    store, _ = store_for(paths, tmp_path / "stores", SIDES)
    train_set = stored(paths, store, train_transform(48))
    batches = [[(index, index + 10) for index in range(5)]]
    here = list(DataLoader(train_set, batch_sampler=batches))
    spawned = DataLoader(train_set, batch_sampler=batches, num_workers=1, multiprocessing_context=forkserver(),
                         worker_init_fn=mapped_or_fail)  # fmt: skip
    [(images, labels)] = list(spawned)
    assert torch.equal(images, here[0][0]) and torch.equal(labels, here[0][1])


@pytest.mark.fast
def test_the_store_built_by_its_own_command_is_the_one_a_run_maps_from_any_working_folder(
    tmp_path, monkeypatch, capsys
):
    """python -m dataset.store DATA --img-size N builds, before any run, the store that a run at --img-size N on
    DATA maps, the data folder named relatively or not; bad input is one line and exit status 2."""
    for name, count in (("a", 4), ("b", 5)):
        images_of(tmp_path / "data" / name, count)
    monkeypatch.chdir(tmp_path)
    store_module.main(["data", "--img-size", "48", "--store-dir", "stores"])
    assert "Images: 9 decoded once into the store" in capsys.readouterr().out
    stored_images = StoredImages(tmp_path / "stores", SIDES, None, fallback=None)
    read_split_data(tmp_path / "data", verify_images=stored_images)
    assert stored_images.line.startswith("Images: 9 from the store")
    with pytest.raises(SystemExit) as exit:
        store_module.main(["missing", "--store-dir", "stores"])
    assert exit.value.code == 2 and capsys.readouterr().err == "error: data path missing does not exist\n"
