"""Epochs that start at once (my_dataset.py): the next pass of a loader started as the last one ends."""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from multi_train_utils.distributed_utils import shuffled_batches
from my_dataset import EpochsAhead

pytestmark = pytest.mark.fast  # loader workers, no script started, nothing trained


class Logged(Dataset):
    """Items that each leave a file named after their (index, seed) in `folder` as a worker loads them."""

    def __init__(self, folder, count: int):
        self.folder, self.count = folder, count

    def __len__(self):
        return self.count

    def __getitem__(self, pair):
        index, seed = pair
        (self.folder / f"{index}-{seed}").touch()
        return torch.tensor(index)


def loaded(folder) -> set[str]:
    return {path.name for path in folder.iterdir()}


def names(batch_pairs) -> set[str]:
    return {f"{index}-{seed}" for index, seed in batch_pairs}


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("persistent", [True, False])
def test_the_next_epochs_first_batches_are_loaded_before_the_loop_asks_for_them(tmp_path, persistent):
    data = Logged(tmp_path, 24)
    batches = shuffled_batches(data, 4, seed=0)
    loader = EpochsAhead(DataLoader(data, batch_sampler=batches, num_workers=1, persistent_workers=persistent), 3)
    plain = DataLoader(data, batch_sampler=shuffled_batches(data, 4, seed=0))
    for epoch in range(3):
        batches.set_epoch(epoch)  # as the epoch loop does: the epoch the pass started ahead was for
        plain.batch_sampler.set_epoch(epoch)
        assert [batch.tolist() for batch in loader] == [batch.tolist() for batch in plain]  # the same batches
        following = shuffled_batches(data, 4, seed=0)
        following.set_epoch(epoch + 1)
        first = names(next(iter(following)))
        if persistent and epoch < 2:  # loaded by the worker before the loop asks for the next epoch
            assert wait_for(lambda first=first: first <= loaded(tmp_path)), (epoch, first)
        else:  # the last epoch starts nothing after it; without persistent workers, the loader is as it was
            time.sleep(0.5)
            assert not first & loaded(tmp_path)


def test_a_pass_for_another_epoch_than_the_one_started_ahead_is_that_epochs(tmp_path):
    data = Logged(tmp_path, 24)
    batches = shuffled_batches(data, 4, seed=0)
    loader = EpochsAhead(DataLoader(data, batch_sampler=batches, num_workers=1, persistent_workers=True))
    list(loader)  # epoch 0; epoch 1 started ahead
    batches.set_epoch(5)
    expected = shuffled_batches(data, 4, seed=0)
    expected.set_epoch(5)
    assert [batch.tolist() for batch in loader] == [[index for index, _ in batch] for batch in expected]
    assert len(loader) == len(batches) == 6
