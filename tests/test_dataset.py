"""MyDataSet: every image mode becomes a 3-channel 8-bit tensor; augmentation follows the per-sample seed; images
decoded once into memory give exactly what their files give."""

import contextlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

import dataset.in_memory as decoding
from dataset.images import SKIPPED, load_rgb
from dataset.in_memory import decode_once, in_chunks
from dataset.sampling import SeededBatchSampler, sample_seed
from dataset.transforms import normalise, train_transform, val_transform
from multi_train_utils.distributed_utils import Process
from my_dataset import MyDataSet

pytestmark = pytest.mark.fast  # no script started, no training run


def save(path, mode):
    rng = np.random.default_rng(0)
    if mode in ("I;16", "I"):
        image = Image.fromarray(rng.integers(0, 65535, (30, 40), dtype=np.uint16))
        image = image if mode == "I;16" else image.convert("I")
    elif mode == "F":
        image = Image.fromarray(rng.random((30, 40), dtype=np.float32) * 255)
    elif mode == "P+transparency":
        image = Image.new("P", (40, 30), 3)
        image.info["transparency"] = 3
    else:
        image = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).convert(mode)
    suffix = ".tiff" if mode in ("CMYK", "F", "I") else ".png"
    path = path.with_suffix(suffix)
    image.save(path)
    return path


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "P+transparency", "RGB", "RGBA", "CMYK", "I;16", "I", "F"])
def test_every_image_mode_loads_as_three_channels(tmp_path, mode):
    path = save(tmp_path / "image", mode)
    assert load_rgb(path).mode == "RGB"
    image, label = MyDataSet([path], [3], val_transform(32))[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8  # normalised on the device, by batch_to
    assert label == 3


def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(np.array([[65535, 4096]], dtype=np.uint16)).save(path)
    image = load_rgb(path)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 0)) == (16, 16, 16)


def test_augmentation_is_a_function_of_the_sample_seed(tmp_path):
    path = save(tmp_path / "image", "RGB")
    dataset = MyDataSet([path], [0], train_transform(24))
    first, _ = dataset[(0, 1234)]
    torch.manual_seed(99)  # the global generator must not matter
    again, _ = dataset[(0, 1234)]
    other, _ = dataset[(0, 1235)]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_seeded_batches_tag_each_index_with_its_epoch_seed():
    class Shuffle:
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    class Batches(list):
        sampler = Shuffle()

    seeded = SeededBatchSampler(Batches([[4, 2], [7, 1]]), seed=5)
    seeded.set_epoch(3)
    assert list(seeded) == [
        [(4, sample_seed(5, 3, 4)), (2, sample_seed(5, 3, 2))],
        [(7, sample_seed(5, 3, 7)), (1, sample_seed(5, 3, 1))],
    ]
    assert Batches.sampler.epochs == [3]
    assert len({sample_seed(5, e, i) for e in range(10) for i in range(100)}) == 1000


def test_a_large_jpeg_is_decoded_at_reduced_scale_to_nearly_the_same_tensor(tmp_path):
    path = tmp_path / "photo.jpg"
    smooth = Image.fromarray(np.random.default_rng(0).integers(0, 255, (15, 20, 3), dtype=np.uint8))
    smooth.resize((1600, 1200), Image.BICUBIC).save(path, quality=90)  # a photo-like image: no pixel noise

    # The transforms say how small an image they can take: validation resizes to 73, training crops as little as
    # 8 % of the area at aspect 3:4, 0.245 of the short side, so needs 262.
    assert (val_transform(64).min_side, train_transform(64).min_side) == (73, 262)
    assert load_rgb(path, min_side=val_transform(64).min_side).size == (200, 150)  # 1/8 scale: short side 150 >= 73
    assert load_rgb(path, min_side=train_transform(64).min_side).size == (400, 300)  # 1/4: 300 >= 262
    assert load_rgb(path, min_side=2000).size == (1600, 1200)  # never smaller than asked
    transform = val_transform(64)
    full, reduced = (normalise(transform(load_rgb(path, min_side))) for min_side in (None, transform.min_side))
    assert (full - reduced).abs().mean() < 0.02  # normalised units: about half a grey level
    png = tmp_path / "photo.png"
    Image.open(path).save(png)
    assert load_rgb(png, min_side=transform.min_side).size == (1600, 1200)  # only JPEG decodes at reduced scale


def varied_images(folder) -> list:
    """Files that load_rgb decodes each its own way: a large JPEG (decoded at reduced scale), a JPEG stored
    sideways with an EXIF rotation, an RGBA PNG, a 16-bit grey PNG, a small JPEG, and a file that is no image."""
    rng = np.random.default_rng(0)
    smooth = Image.fromarray(rng.integers(0, 255, (15, 20, 3), dtype=np.uint8)).resize((1600, 1200), Image.BICUBIC)
    smooth.save(folder / "large.jpg", quality=90)
    sideways = Image.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8))
    exif = sideways.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    sideways.save(folder / "sideways.jpg", exif=exif)
    Image.fromarray(rng.integers(0, 255, (50, 70, 4), dtype=np.uint8), "RGBA").save(folder / "alpha.png")
    Image.fromarray(rng.integers(0, 65535, (40, 30), dtype=np.uint16)).save(folder / "grey16.png")
    Image.fromarray(rng.integers(0, 255, (80, 100, 3), dtype=np.uint8)).save(folder / "small.jpg")
    (folder / "broken.jpg").write_bytes(b"not a JPEG")
    return [
        folder / name for name in ("large.jpg", "sideways.jpg", "alpha.png", "grey16.png", "small.jpg", "broken.jpg")
    ]


@pytest.mark.parametrize("transform", ["train", "val"])
def test_images_decoded_once_give_exactly_the_items_their_files_give(tmp_path, transform, capsys, monkeypatch):
    paths = varied_images(tmp_path)
    monkeypatch.setattr(decoding, "in_chunks", partial(in_chunks, chunk=2))  # the threads' tasks: 3 chunks
    preset = (
        train_transform(48, auto_augment="trivialaugment", random_erase=0.5)
        if transform == "train"
        else val_transform(48)
    )
    from_files = MyDataSet(paths, list(range(len(paths))), preset)
    in_memory = MyDataSet(paths, list(range(len(paths))), preset)
    line = decode_once([in_memory], gigabytes=1)
    assert line.startswith("Images: 5 decoded once into memory")
    assert load_rgb(paths[1]).size == (60, 90)  # the sideways JPEG, turned upright as its EXIF says
    assert in_memory.decoded.offsets[-1] == -1  # the broken file: read (and skipped) at its turn, as before
    for index in range(len(paths)):
        for seed in (1, 2, 3):
            (expected, expected_label), (got, label) = from_files[(index, seed)], in_memory[(index, seed)]
            assert expected.dtype == got.dtype == torch.uint8
            assert torch.equal(expected, got) and label == expected_label
    assert label == SKIPPED and "skipped unreadable image" in capsys.readouterr().err


def test_the_decoding_threads_take_the_images_in_chunks_and_give_the_results_in_order():
    with ThreadPoolExecutor(2) as pool:
        assert in_chunks(pool, lambda i: i * i, range(7), chunk=2) == [i * i for i in range(7)]
        assert in_chunks(pool, lambda i: i, []) == []


@contextlib.contextmanager
def group_of_one():
    """A process group (gloo) of this process alone, for the collectives of the code inside."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_images_are_decoded_once_only_where_they_fit_the_memory_budget(tmp_path, monkeypatch):
    paths = varied_images(tmp_path)[1:5]
    data = MyDataSet(paths, [0] * len(paths), val_transform(32))
    needed = sum(np.asarray(load_rgb(path, data.min_side)).size for path in paths)  # bytes, decoded
    assert decode_once([data], gigabytes=0) == "Images: decoded from their files every epoch (--image-cache-gb 0)"
    line = decode_once([data], gigabytes=(needed - 1) / 1e9)
    assert data.decoded is None and "they would take 0.0 GB, more than the 0.0 GB of --image-cache-gb" in line
    # By default a quarter of the memory the run may use (machine.memory_limit), shared among its processes here
    monkeypatch.setattr(decoding, "memory_limit", lambda: (4 * needed, "SLURM's --mem, SLURM_MEM_PER_NODE"))
    monkeypatch.setattr(decoding, "SHARED_FOLDERS", [tmp_path])
    with group_of_one():  # decode_once meets the other processes of its machine (here: none) in the group
        line = decode_once([data], None, Process(local_world_size=2))
    assert "decoded from their files" in line and data.decoded is None
    assert f"of the {4 * needed / 1e9:.1f} GB this run may use (SLURM's --mem, SLURM_MEM_PER_NODE)" in line
    line = decode_once([data], None, Process())
    assert "4 decoded once" in line and data.decoded is not None and "SLURM_MEM_PER_NODE" in line
    monkeypatch.setattr(decoding, "memory_limit", lambda: (None, "this system does not say its memory"))
    assert "does not say its memory" in decode_once([MyDataSet(paths, [0] * 4, val_transform(32))], None)


def test_an_image_that_decodes_to_another_size_than_its_header_says_is_read_from_its_file(tmp_path, monkeypatch):
    paths = varied_images(tmp_path)[:5]
    monkeypatch.setattr(decoding, "decoded_size", lambda path, min_side: (7, 9))  # a header that misleads
    data = MyDataSet(paths, [0] * len(paths), val_transform(32))
    decode_once([data], gigabytes=1)
    assert data.decoded.offsets.tolist() == [-1] * 5
    assert all(torch.equal(data[i][0], MyDataSet(paths, [0] * 5, val_transform(32))[i][0]) for i in range(5))
