"""Run a function in N gloo processes on this machine, the way the spawn script does, for in-process tests."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import find_free_port


def _join_and_run(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_world(fn, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) in world_size processes joined in a gloo group; re-raises any failure."""
    mp.spawn(_join_and_run, args=(world_size, find_free_port(), fn, args), nprocs=world_size, join=True)
