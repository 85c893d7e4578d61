"""Train ResNet-34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --demo --world-size 2
    CUDA_VISIBLE_DEVICES=0,1 python train_multi_gpu_using_spawn.py --data-path flower_photos

No launcher needed: this process checks the input, picks a free port for the group to meet on, then starts
--world-size copies of `worker`, each told its rank. If one of them fails, spawn stops the others.
"""

import os
import sys

import torch
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import cleanup, find_free_port, init_distributed_mode, resolve_device
from training import parse_args, prepare, train
from utils import UserError, exits_on_user_error


@exits_on_user_error
def worker(rank: int, args) -> None:
    init_distributed_mode(args, rank=rank, world_size=args.world_size)
    try:
        train(args)
    finally:
        cleanup()


@exits_on_user_error
def main(argv=None):
    args = parse_args("train_multi_gpu_using_spawn", __doc__.splitlines()[0], argv)
    prepare(args)
    gpus = torch.cuda.device_count() if resolve_device(args.device).type == "cuda" else 0
    if args.world_size is None:
        args.world_size = gpus or 2
    elif gpus and args.world_size > gpus:
        raise UserError(f"--world-size {args.world_size} but only {gpus} GPUs are visible (one process per GPU)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    print(f"Starting {args.world_size} processes; they meet at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    try:
        mp.spawn(worker, args=(args,), nprocs=args.world_size, join=True)
    except mp.ProcessExitedException as error:
        # A worker that met bad input has printed its one-line error and exited 2; pass its status on.
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)


if __name__ == "__main__":
    main()
