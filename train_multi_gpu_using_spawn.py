"""Train ResNet-34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --demo --world-size 2
    CUDA_VISIBLE_DEVICES=0,1 python train_multi_gpu_using_spawn.py --data-path flower_photos

No launcher needed: this process checks the input, picks a free port for the group to meet on, then starts
--world-size copies of `worker`, each told its rank. If one of them fails, the others are stopped; if this
process is stopped (Ctrl-C, SIGTERM), it stops them too.
"""

import os
import signal
import sys
import traceback

import torch
import torch.multiprocessing as mp

from multi_train_utils.distributed_utils import (
    cleanup,
    find_free_port,
    init_distributed_mode,
    port_is_free,
    resolve_device,
)
from training import parse_args, prepare, train
from utils import UserError, entry_point


@entry_point
def worker(rank: int, args, split) -> None:
    try:
        init_distributed_mode(args, rank=rank, world_size=args.world_size)
        train(args, split)
    except UserError:
        raise
    except Exception:
        # spawn hands the parent only the first failure it notices, often a peer's "connection closed": print
        # every worker's own traceback, so the one that failed first is always shown.
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        cleanup()


@entry_point
def main(argv=None):
    args = parse_args("train_multi_gpu_using_spawn", __doc__.splitlines()[0], argv)
    gpus = torch.cuda.device_count() if resolve_device(args.device).type == "cuda" else 0
    if args.world_size is None:
        args.world_size = gpus or 2
    elif gpus and args.world_size > gpus:
        raise UserError(f"--world-size {args.world_size} but only {gpus} GPUs are visible (one process per GPU)")
    split = prepare(args, args.world_size)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None or not port_is_free(int(port)):
        os.environ["MASTER_PORT"] = str(find_free_port())
        if port is not None:
            print(f"MASTER_PORT {port} is taken; using {os.environ['MASTER_PORT']} instead")
    print(f"Starting {args.world_size} processes; they meet at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    context = mp.start_processes(worker, args=(args, split), nprocs=args.world_size, join=False, start_method="spawn")
    try:
        while not context.join():  # raises as soon as any worker fails, after stopping the others
            pass
    except mp.ProcessExitedException as error:
        # The worker printed its error (one line for bad input, exit 2; a traceback otherwise): pass its status on.
        if error.exit_code != 2:
            print(f"error: worker {error.error_index} ended with status {error.exit_code}", file=sys.stderr)
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
    finally:
        for process in context.processes:  # on SIGTERM or Ctrl-C here: no worker outlives this process
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join()


if __name__ == "__main__":
    main()
