"""Seeded sampling: each image's augmentation drawn from a seed of (seed, epoch, index), whatever loads it."""

import itertools

import numpy as np
from torch.utils.data import Sampler


class SeededBatchSampler(Sampler):
    """A batch sampler (of a DistributedSampler) whose indices go out as (index, seed of (seed, epoch, index))."""

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler, self.seed, self.epoch, self.start = batch_sampler, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_sampler.sampler.set_epoch(epoch)

    def start_at(self, batch: int) -> None:
        """The next pass skips the epoch's first `batch` batches, where a run stopped at a step resumes."""
        self.start = batch

    def __iter__(self):
        start, self.start = self.start, 0
        for batch in itertools.islice(self.batch_sampler, start, None):
            yield list(zip(batch, sample_seeds(self.seed, self.epoch, batch).tolist(), strict=True))

    def __len__(self):
        return len(self.batch_sampler)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch; distinct (seed, epoch, index) give unrelated streams."""
    return seed_of(seed, epoch, index)


def sample_seeds(seed: int, epoch: int, indices) -> np.ndarray:
    """sample_seed for every index (each below 2**32) at once, as uint64 (tests/test_on_device.py checks they agree)."""
    words = [np.full(len(indices), word, dtype=np.uint32) for word in [*uint32_words(seed), *uint32_words(epoch)]]
    words.append(np.asarray(indices, dtype=np.uint64).astype(np.uint32))
    hashes = seed_sequence_hashes(SEED_INIT_A, SEED_MULT_A)  # the pool: the key's words hashed (zeros past its end)
    pool = [seed_hash(words[i] if i < len(words) else np.zeros_like(words[0]), next(hashes)) for i in range(SEED_POOL)]
    for source in range(SEED_POOL):  # every word mixed into every other
        for target in range(SEED_POOL):
            if source != target:
                pool[target] = seed_mix(pool[target], seed_hash(pool[source], next(hashes)))
    for source in range(SEED_POOL, len(words)):  # the key's words past the pool's size
        for target in range(SEED_POOL):
            pool[target] = seed_mix(pool[target], seed_hash(words[source], next(hashes)))
    hashes = seed_sequence_hashes(SEED_INIT_B, SEED_MULT_B)
    low, high = (seed_hash(pool[i], next(hashes), multiply_first=False) for i in range(2))  # generate_state(1, u64)
    return ((high.astype(np.uint64) << np.uint64(32)) | low.astype(np.uint64)) >> np.uint64(1)


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx), for sample_seeds
SEED_POOL, SEED_INIT_A, SEED_MULT_A, SEED_INIT_B, SEED_MULT_B = 4, 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
SEED_MIX_L, SEED_MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)


def seed_sequence_hashes(init: int, mult: int):
    """The hash constants SeedSequence uses in turn."""
    constant = init
    while True:
        yield constant
        constant = constant * mult % 2**32


def seed_hash(values: np.ndarray, constant: int, multiply_first: bool = True) -> np.ndarray:
    """SeedSequence's hashmix of uint32 `values` with hash constant `constant` (it multiplies by the next one)."""
    mult = SEED_MULT_A if multiply_first else SEED_MULT_B
    values = (values ^ np.uint32(constant)) * np.uint32(constant * mult % 2**32)
    return values ^ (values >> np.uint32(16))


def seed_mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = SEED_MIX_L * x - SEED_MIX_R * y
    return result ^ (result >> np.uint32(16))


def uint32_words(value: int) -> list[int]:
    """A non-negative int as SeedSequence reads it: its 32-bit words, lowest first ([0] for 0)."""
    return [value >> shift & 0xFFFFFFFF for shift in range(0, max(value.bit_length(), 1), 32)]


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """A 63-bit seed for what a step draws on process `rank` (dropout's masks), unrelated to every sample's."""
    return seed_of(seed, epoch, step, rank, 1)


def seed_of(*key: int) -> int:
    """A 63-bit seed for `key`: keys that differ other than by trailing zeros give unrelated streams."""
    return int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0] >> 1)
