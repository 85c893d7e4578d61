"""Train ResNet-34 with DistributedDataParallel, processes started by torch.multiprocessing.spawn.

    python train_multi_gpu_using_spawn.py --demo --world-size 2
    CUDA_VISIBLE_DEVICES=0,1 python train_multi_gpu_using_spawn.py --data-path flower_photos

No launcher needed: this process checks the input, picks a free port for the group to meet on, then starts
--world-size copies of `worker`, each told its rank. If one of them fails, the others are stopped; if this
process is stopped (Ctrl-C, SIGTERM), it stops them too (multi_train_utils/spawn_utils.py).
"""

from flags import parse_args, prepare
from multi_train_utils.distributed_utils import cleanup, init_distributed_mode
from multi_train_utils.spawn_utils import choose_meeting_point, report_failures, run_workers, spawn_world_size
from training import train
from utils import entry_point


@entry_point
@report_failures
def worker(rank: int, args, plan, world_size: int) -> None:
    process = init_distributed_mode(
        args.device, args.dist_backend, args.dist_url, args.dist_timeout, rank=rank, world_size=world_size
    )
    try:
        train(args, plan, process)
    finally:
        cleanup()


@entry_point
def main(argv=None):
    args = parse_args("train_multi_gpu_using_spawn", __doc__.splitlines()[0], argv)
    world_size = spawn_world_size(args.world_size, args.device)
    plan = prepare(args, world_size)
    print(f"Starting {world_size} processes; they meet at {choose_meeting_point()}")
    run_workers(worker, (args, plan, world_size), world_size)


if __name__ == "__main__":
    main()
