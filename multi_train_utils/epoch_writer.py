"""Saving that does not stop training: an epoch's files, copied to host memory, written by a background thread while
the next epoch trains, one epoch at a time, as promised (docs/resuming-and-failures.md, Saving in the background)."""

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
        """Run job() in the background once the last epoch's write is done; `after`, once it is on disk, in the
        caller's thread at the next wait()."""
        self.wait()
        self.pending = self.pool.submit(job), after

    def wait(self) -> None:
        """Until the write in flight is on disk; then its `after`. Raises the write's own error, once."""
        if self.pending is None:
            return
        future, after = self.pending
        self.pending = None
        future.result()
        if after is not None:
            after()


def on_host(tree):
    """(`tree` with every tensor copied to host memory as it is now, each once; a function that waits until the
    copies have arrived): from a GPU, copies queued on its stream, so the caller waits for none of them."""
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
