"""Saving that does not stop training: an epoch's files written by a background thread while the next epoch trains.

At an epoch's end the loop takes one copy of what the epoch leaves (its weights, best weights and checkpoint) to
host memory (`on_host`: from a GPU, copies queued on its stream, so the loop waits for none of them), hands the
writing to the writer's thread, and goes on. The writer keeps every promise of the synchronous writes
(docs/resuming-and-failures.md): each file is written atomically (a new file renamed over the old, so kill -9
during a write leaves the previous files loadable), in the same order (metrics, weights, then the checkpoint), and
one epoch at a time: before the loop hands over the next epoch's files it waits for the last epoch's, so two writes
of one file never overlap and at most one epoch's copy is in memory. A write that failed (a full disk) raises its
error there, at the next epoch's end, on rank 0, which stops every rank; a stop signal, the run's end or a crash
waits for the write in flight (the thread is not a daemon). What must follow a write, the tracker's record of the
epoch, is done by the loop's thread once the write is on disk (`after`).
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils._pytree import tree_map


class EpochWriter:
    """One background thread that writes epochs' files, one epoch at a time, in the order they were handed over."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-writer")
        self.pending: tuple[Future, Callable | None] | None = None

    def write(self, job: Callable[[], None], after: Callable[[], None] | None = None) -> None:
        """Run job() (writing an epoch's files, from host copies) in the background, after the last epoch's write
        (wait() first); `after`, once it is on disk, in the caller's thread at the next wait()."""
        self.wait()
        self.pending = self.pool.submit(job), after

    def wait(self) -> None:
        """Until the write in flight is on disk; then its `after`. Raises the write's own error (OutputError for a
        full disk), once."""
        if self.pending is None:
            return
        future, after = self.pending
        self.pending = None
        future.result()
        if after is not None:
            after()


def on_host(tree):
    """`tree` (a state_dict, a checkpoint: tensors in dicts and lists) with every tensor copied to host memory, as it
    is now: from a GPU, a copy to pinned memory queued on the current stream (the writer waits for it: `ready`),
    on the CPU a clone; a tensor found twice (the model's weights in the checkpoint too) copied once. Returns (the
    copy, a function that waits until the copies have arrived)."""
    cuda, copies = [], {}

    def copy(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in copies:
            if value.is_cuda:
                cuda.append(value.device)
                copies[id(value)] = value, value.detach().to("cpu", non_blocking=True)
            else:
                copies[id(value)] = value, value.detach().clone()
        return copies[id(value)][1]  # (the original is kept beside it: its id stays its own meanwhile)

    copied = tree_map(copy, tree)
    events = []
    for device in dict.fromkeys(cuda):  # one event per GPU, after its copies
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return copied, lambda: [event.synchronize() for event in events]
