"""The boxes and flips the training transforms draw from each image's seed, an epoch's at once (docs/performance.md)."""

import numpy as np
import torch
from torchvision.transforms import v2

WORDS = 23  # 10 tries of 2 draws, the box's top and left, the flip's draw
MERSENNE_M = 397  # MT19937's middle word: the first twist of word j reads words j, j + 1 and j + 397
MATRIX_A = np.uint32(0x9908B0DF)
CLOSE_TO_HALF = 1e-4  # a square root this close to a half-integer: the transforms' own arithmetic decides


def mt19937_words(seeds: np.ndarray, count: int = WORDS) -> np.ndarray:
    """The first `count` words of torch's CPU generator after manual_seed(seed), per seed: (len(seeds), count)."""
    rows = MERSENNE_M + count
    state = np.empty((rows, len(seeds)), dtype=np.uint32)
    state[0] = np.asarray(seeds, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    for j in range(1, rows):  # uint32 arithmetic wraps, as the generator's does
        previous = state[j - 1]
        state[j] = np.uint32(1812433253) * (previous ^ (previous >> np.uint32(30))) + np.uint32(j)
    mixed = (state[:count] & np.uint32(0x80000000)) | (state[1 : count + 1] & np.uint32(0x7FFFFFFF))
    words = state[MERSENNE_M : MERSENNE_M + count] ^ (mixed >> np.uint32(1))
    words ^= np.where(state[1 : count + 1] & np.uint32(1), MATRIX_A, np.uint32(0))
    words ^= words >> np.uint32(11)
    words ^= (words << np.uint32(7)) & np.uint32(0x9D2C5680)
    words ^= (words << np.uint32(15)) & np.uint32(0xEFC60000)
    words ^= words >> np.uint32(18)
    return words.T


def uniform(words: np.ndarray, low: float, high: float) -> np.ndarray:
    """torch's float32 uniform_(low, high) from each 32-bit word, as float64 (what .item() gives)."""
    low32, high32 = np.float32(low), np.float32(high)
    fraction = (words & np.uint32(0xFFFFFF)).astype(np.float64) * 2.0**-24
    return (fraction * np.float64(high32 - low32) + np.float64(low32)).astype(np.float32).astype(np.float64)


def draw(crop: v2.RandomResizedCrop, flip: v2.RandomHorizontalFlip, seeds, heights, widths):
    """Each image's box (top, left, height, width: int64 (n, 4)) and flip, as drawn after manual_seed(its seed)."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    heights, widths = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    words = mt19937_words(seeds)
    tries = 10
    area = (heights * widths).astype(np.float64)
    log_low, log_high = (float(value) for value in torch.log(torch.tensor(crop.ratio)))
    target = area[:, None] * uniform(words[:, 0 : 2 * tries : 2], *crop.scale)
    aspect = np.exp(uniform(words[:, 1 : 2 * tries : 2], log_low, log_high)).astype(np.float32).astype(np.float64)
    width_roots, height_roots = np.sqrt(target * aspect), np.sqrt(target / aspect)
    box_w, box_h = np.round(width_roots).astype(np.int64), np.round(height_roots).astype(np.int64)
    fits = (box_w > 0) & (box_w <= widths[:, None]) & (box_h > 0) & (box_h <= heights[:, None])
    found = fits.any(axis=1)
    first = np.where(found, fits.argmax(axis=1), tries)  # the try that fits (tries: none did)
    rows, at = np.arange(len(seeds)), np.minimum(first, tries - 1)
    box_w, box_h = np.where(found, box_w[rows, at], 0), np.where(found, box_h[rows, at], 0)
    used = np.where(found, 2 * first + 2, 2 * tries)  # words taken by the tries (and then the top and left)
    top = words[rows, np.minimum(used, WORDS - 1)].astype(np.int64) % np.maximum(heights - box_h + 1, 1)
    left = words[rows, np.minimum(used + 1, WORDS - 1)].astype(np.int64) % np.maximum(widths - box_w + 1, 1)
    flips = uniform(words[rows, np.where(found, used + 2, used)], 0.0, 1.0) < flip.p
    boxes = np.stack([top, left, box_h, box_w], axis=1)
    for i in np.flatnonzero(~found):  # no try fits: the central crop, its aspect clamped to crop.ratio
        height, width = int(heights[i]), int(widths[i])
        h, w = min(height, round(width / min(crop.ratio))), min(width, round(height * max(crop.ratio)))
        boxes[i] = (height - h) // 2, (width - w) // 2, h, w
    # Where rounding a square root was close to a tie, in any try up to the one that fit: the transforms decide
    tried = np.arange(tries)[None, :] <= at[:, None]
    close = (close_to_half(width_roots) | close_to_half(height_roots)) & tried
    for i in np.flatnonzero(close.any(axis=1)):
        boxes[i], flips[i] = drawn_by_the_transforms(crop, flip, int(seeds[i]), int(heights[i]), int(widths[i]))
    return boxes, flips


def close_to_half(roots: np.ndarray) -> np.ndarray:
    return np.abs(roots - np.floor(roots) - 0.5) < CLOSE_TO_HALF


def drawn_by_the_transforms(crop, flip, seed: int, height: int, width: int) -> tuple[list[int], bool]:
    """An image's box and flip as the transforms draw them after manual_seed(seed), this process's generator kept."""
    make_params = getattr(crop, "make_params", None) or crop._get_params  # torchvision before 0.21: _get_params
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        params = make_params([torch.empty(()).expand(3, height, width)])  # an image's size, no pixels
        flipped = bool(torch.rand(1) < flip.p)
    return [params["top"], params["left"], params["height"], params["width"]], flipped
