"""MyDataSet: every image mode becomes a 3-channel 8-bit tensor; augmentation follows the per-sample seed; images
from the image store give exactly what their files give (tests/test_store.py)."""

import numpy as np
import pytest
import torch
from PIL import Image

from dataset.images import load_rgb
from dataset.sampling import SeededBatchSampler, sample_seed
from dataset.transforms import normalise, train_transform, val_transform
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
