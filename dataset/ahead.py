"""Epochs that start at once: a loader whose next pass begins as soon as the last one ends."""

from torch.utils.data import DataLoader


class EpochsAhead:
    """A DataLoader (with persistent workers) whose next pass starts as soon as a pass ends: its workers load the
    next epoch's first batches (prefetch_factor each) while this process trains on the last ones (on a GPU, whose
    steps the host only queues), validates and saves, so that no epoch starts by waiting for them. The pass started
    is the batch sampler's next epoch (set_epoch(epoch + 1), before any index is drawn); the epoch loop then sets that
    epoch again, to the same value. A pass asked for another epoch than the one started (a resumed run's first)
    drops the one started and begins anew. Without persistent workers (--no-persistent-workers: the original's
    loader, which starts its workers every epoch) it is the loader as it is."""

    def __init__(self, loader: DataLoader, epochs: int | None = None):
        self.loader, self.epochs = loader, epochs
        self.dataset, self.batch_sampler = loader.dataset, loader.batch_sampler  # as the loader's
        self.started = None  # (the epoch of the pass started ahead, its iterator)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        epoch = getattr(self.batch_sampler, "epoch", None)  # a validation loader's passes are all alike: None
        started, self.started = self.started, None
        yield from started[1] if started is not None and started[0] == epoch else iter(self.loader)
        if self.loader.persistent_workers and (epoch is None or self.epochs is None or epoch + 1 < self.epochs):
            if epoch is not None:
                self.batch_sampler.set_epoch(epoch + 1)
            self.started = (None if epoch is None else epoch + 1, iter(self.loader))
