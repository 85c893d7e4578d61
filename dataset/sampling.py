"""Seeded sampling: every training image's random augmentation drawn from a seed of its own, a function of (seed,
epoch, index), so that it does not depend on which loader worker, or how many, loads it."""

import itertools

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class SeededSamples(Dataset):
    """A dataset whose items are asked for as (index, seed), as SeededBatchSampler gives them: the random
    augmentation of each is drawn from `seed` alone, so it does not depend on which loader worker (or how many)
    loads it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        index, seed = item
        with torch.random.fork_rng(devices=[]):
            # The CPU's generator alone, which the transforms draw from: torch.manual_seed would also queue seeds
            # for CUDA, XPU and MTIA, each with a formatted stack trace, a third of an item's time at 48 px.
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


class SeededBatchSampler(Sampler):
    """Wraps a batch sampler: each index goes out as (index, seed), the seed a function of (seed, epoch, index).

    `set_epoch` is passed on to the wrapped sampler (a DistributedSampler), which reshuffles by epoch. `start_at`
    makes the next pass begin part way through the epoch, where a run stopped at a step resumes.
    """

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler = batch_sampler
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_sampler.sampler.set_epoch(epoch)

    def start_at(self, batch: int) -> None:
        """The next pass skips the epoch's first `batch` batches (their images are not loaded); later passes
        start at 0."""
        self.start = batch

    def __iter__(self):
        start, self.start = self.start, 0
        for batch in itertools.islice(self.batch_sampler, start, None):
            yield [(index, sample_seed(self.seed, self.epoch, index)) for index in batch]

    def __len__(self):
        return len(self.batch_sampler)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch; distinct (seed, epoch, index) give unrelated streams."""
    return seed_of(seed, epoch, index)


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """A 63-bit seed for what training step `step` of `epoch` draws on process `rank` (dropout's masks, ...),
    unrelated to every sample's (its key ends in 1: a sample's is as if padded with zeros)."""
    return seed_of(seed, epoch, step, rank, 1)


def seed_of(*key: int) -> int:
    """A 63-bit seed of its own for each `key`: keys that differ other than by trailing zeros give unrelated
    streams (numpy's SeedSequence pads a shorter key with zeros)."""
    return int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0] >> 1)
