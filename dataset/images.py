"""Reading an image file: any image as 8-bit RGB (large JPEGs at reduced scale), its size, whether it decodes."""

import math

import numpy as np
from PIL import ExifTags, Image, ImageOps

# The label my_dataset.MyDataSet gives an image that could not be read during a run: the loss and counts skip it.
SKIPPED = -100


def image_problem(path) -> str | None:
    """Why PIL cannot decode this file (truncated, not an image, ...), or None if it can."""
    try:
        with Image.open(path) as image:
            image.draft("RGB", (32, 32))  # JPEGs decode at reduced scale: fast, and still reads every byte
            image.load()
    except Exception as error:  # PIL raises many types for bad files; each means "unusable image"
        return f"{type(error).__name__}: {error}"
    return None


def load_rgb(path, min_side: int | None = None) -> Image.Image:
    """Any image PIL reads (grey, palette, alpha, CMYK, 16-bit, float) as 8-bit RGB, JPEGs drafted to `min_side`."""
    with Image.open(path) as image:
        draft(image, min_side)
        image = ImageOps.exif_transpose(image)  # phone photos are often stored sideways with a rotation tag
        if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
            # 16-bit and float pixels: scale to 0..255 instead of clipping everything above 255 to white.
            pixels = np.asarray(image, dtype=np.float64)
            peak = 65535.0 if image.mode != "F" or pixels.max() > 255 else 255.0
            image = Image.fromarray(np.clip(np.rint(pixels * (255.0 / peak)), 0, 255).astype(np.uint8), mode="L")
        elif "A" in image.mode or "transparency" in image.info:
            image = image.convert("RGBA")
        return image.convert("RGB")


def draft(image: Image.Image, min_side: int | None) -> None:
    """Have PIL decode the JPEG `image` at 1/2, 1/4 or 1/8 scale with its shorter side at least `min_side`."""
    if min_side is not None and min(image.size) > 2 * min_side:
        scale = min_side / min(image.size)
        image.draft("RGB", (math.ceil(image.width * scale), math.ceil(image.height * scale)))


def decoded_size(path, min_side: int | None = None) -> tuple[int, int] | None:
    """(height, width) of load_rgb(path, min_side)'s image from the header alone; None if PIL cannot open it."""
    try:
        with Image.open(path) as image:
            draft(image, min_side)
            width, height = image.size
            quarter_turn = image.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)
    except Exception:  # PIL raises many types for a file that is not an image
        return None
    return (width, height) if quarter_turn else (height, width)


def capped(size: tuple[int, int], cap: int) -> tuple[int, int]:
    """(height, width) with the shorter side brought down to `cap` where it is longer."""
    return tuple(size) if min(size) <= cap else tuple(max(1, round(side * cap / min(size))) for side in size)


def write_decoded(task) -> list[tuple[int, bool]]:
    """A building process's share of an image store: each image decoded by load_rgb at each of `min_sides` (once a
    shape), resized where capped, written at its offset; (its index, whether it decoded as its header said) each."""
    store, start, images, min_sides, cap = task
    done = []
    with open(store, "r+b") as file:
        for index, path, offsets, shapes in images:
            ok = True
            for entry, (min_side, offset, (height, width)) in enumerate(zip(min_sides, offsets, shapes, strict=True)):
                if [height, width] in shapes[:entry]:
                    continue  # its pixels written already
                try:
                    image = load_rgb(path, min_side)
                    if cap is not None and image.size != (width, height):
                        image = image.resize((width, height), Image.Resampling.LANCZOS, reducing_gap=2.0)
                    pixels = np.asarray(image)
                except Exception:  # PIL raises many types for a file that is gone or no longer an image
                    pixels = None
                ok = ok and pixels is not None and pixels.shape == (height, width, 3)
                if ok:
                    file.seek(start + offset)
                    file.write(pixels.tobytes())
            done.append((index, ok))
    return done
