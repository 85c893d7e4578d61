"""Processes sharing decoded images: the processes of one machine decode its images once between them, and loader
workers started by spawn get them through shared memory. Not in the fast tier: each test starts processes, from a
fork server that imports torch once (5 s on 2 cores) instead of an interpreter each (tests/spawn_world.py)."""

import pytest
import torch
from spawn_world import forkserver, spawn_world
from test_dataset import varied_images
from torch.utils.data import DataLoader, get_worker_info

import dataset.in_memory as decoding
from dataset.in_memory import decode_once
from dataset.transforms import train_transform, val_transform
from multi_train_utils.distributed_utils import Process
from my_dataset import MyDataSet


def _decode_in_rank(rank, world_size, paths, out, temporary):
    """One of the processes of a machine: decode `paths` with decode_once, counting the images this process
    decoded itself, sharing them in `temporary` alone; what it holds goes to out/<rank>.pt."""
    decoding.SHARED_FOLDERS = [temporary]
    calls, decode = [], decoding.load_rgb
    decoding.load_rgb = lambda *args, **kwargs: calls.append(args[0]) or decode(*args, **kwargs)
    data = MyDataSet(paths, [0] * len(paths), val_transform(32))
    line = decode_once([data], 1, Process(rank, world_size, rank, world_size))
    held = vars(data.decoded)
    torch.save({"decoded_here": len(calls), "line": line, **held}, out / f"{rank}.pt")


@pytest.mark.parametrize("shareable", [True, False], ids=["shared", "temporary-folder-missing"])
def test_the_processes_of_a_machine_decode_its_images_once_between_them(tmp_path, shareable):
    paths = varied_images(tmp_path)  # 5 images and a broken file, decoded by no one
    temporary = tmp_path / "tmp"
    if shareable:
        temporary.mkdir()
    alone = MyDataSet(paths, [0] * len(paths), val_transform(32))
    decode_once([alone], 1)
    spawn_world(_decode_in_rank, 2, paths, tmp_path, temporary)
    first, second = (torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in (0, 1))
    for held in (first, second):  # every process holds what one process alone decodes
        assert all(torch.equal(held[name], value) for name, value in vars(alone.decoded).items())
    assert first["decoded_here"] == 5 and "on this machine for its 2 processes" in first["line"]
    if shareable:
        assert second["decoded_here"] == 0 and second["line"] == first["line"]
        assert list(temporary.iterdir()) == []  # the file they shared is gone
    else:  # the file could not be written: each decodes its own, and the line says why
        assert second["decoded_here"] == 5 and "each process of this machine decodes its own" in first["line"]


def shared_or_fail(worker: int) -> None:
    pixels = get_worker_info().dataset.decoded.pixels
    if not pixels.is_shared():
        raise AssertionError(f"loader worker {worker} holds a copy of the decoded images")


def test_loader_workers_started_by_spawn_share_the_decoded_images(tmp_path):
    """As on Windows and macOS: a worker started by spawn gets the decoded images through shared memory, not as a
    copy, and loads the same batches as the process itself does. Started here by the forkserver (spawn_world's,
    which has imported torch: spawn's new interpreter would import it for 6-7 s), which hands a worker its dataset
    as spawn does, pickled by multiprocessing's ForkingPickler with torch's shared-memory reductions."""
    paths = varied_images(tmp_path)[:5]
    train_set = MyDataSet(paths, list(range(5)), train_transform(32))
    decode_once([train_set], gigabytes=1)
    batches = [[(index, index + 10) for index in range(5)]]
    here = list(DataLoader(train_set, batch_sampler=batches))
    spawned = DataLoader(
        train_set,
        batch_sampler=batches,
        num_workers=1,
        multiprocessing_context=forkserver(),
        worker_init_fn=shared_or_fail,
    )
    [(images, labels)] = list(spawned)
    assert torch.equal(images, here[0][0]) and torch.equal(labels, here[0][1])
