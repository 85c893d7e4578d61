"""An epoch's files written by a thread as the next trains (docs/resuming-and-failures.md, Saving in the background)."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils._pytree import tree_map


class EpochWriter:
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-writer")
        self.pending: tuple[Future, Callable | None] | None = None

    def write(self, job: Callable[[], None], after: Callable[[], None] | None = None) -> None:
        """Run job() in the background after the last write; `after`, once on disk, in this thread at next wait()."""
        self.wait()
        self.pending = self.pool.submit(job), after

    def wait(self) -> None:
        """Until the write in flight is on disk; then its `after`. Raises the write's own error, once."""
        if self.pending is not None:
            (future, after), self.pending = self.pending, None
            future.result()
            if after is not None:
                after()


def on_host(tree):
    """(`tree`, each tensor copied to the host once as it is now, queued on GPUs; a function waiting for the copies)."""
    copies = {}

    def copy(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in copies:
            host = value.detach().to("cpu", non_blocking=True) if value.is_cuda else value.detach().clone()
            copies[id(value)] = value, host
        return copies[id(value)][1]  # (the original is kept beside it: its id stays its own meanwhile)

    copied, events = tree_map(copy, tree), []
    for device in dict.fromkeys(value.device for value, _ in copies.values() if value.is_cuda):  # after its copies
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return copied, lambda: [event.synchronize() for event in events]
