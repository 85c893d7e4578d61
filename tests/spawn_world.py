"""Run a function in N gloo processes on this machine, for tests of what the processes compute together.

The processes start from a fork server that has imported torch and the project once, instead of each importing
them anew as spawn's would (6-7 s each on a 2-core CPU). The fork server itself computes nothing, so no thread
pool exists to break in the forked copies. The spawn script is tested as users start it, with spawn itself.
"""

import multiprocessing
import os

import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.spawn_utils import find_free_port


def _join_and_run(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def forkserver():
    """multiprocessing's forkserver context, its server importing torch and the project once (when it starts)."""
    multiprocessing.set_forkserver_preload(["torch", "torchvision", "model", "multi_train_utils.train_eval_utils"])
    return multiprocessing.get_context("forkserver")


def spawn_world(fn, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) in world_size processes joined in a gloo group; re-raises any failure."""
    forkserver()
    mp.start_processes(
        _join_and_run, args=(world_size, find_free_port(), fn, args), nprocs=world_size, start_method="forkserver"
    )
