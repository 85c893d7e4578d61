"""Train ResNet-34 with DistributedDataParallel, one process per device, started by a launcher.

    torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --demo
    CUDA_VISIBLE_DEVICES=0,3 torchrun --nproc_per_node=2 train_multi_gpu_using_launch.py --data-path flower_photos

torchrun (or `python -m torch.distributed.launch --use_env`, or SLURM's srun) starts the processes and tells
each one its RANK, WORLD_SIZE and LOCAL_RANK in environment variables; this script reads them and joins the
group. Started with plain `python`, it trains in one process.
"""

from flags import parse_args, prepare
from multi_train_utils.distributed_utils import cleanup, init_distributed_mode, launcher_environment
from training import train
from utils import entry_point


@entry_point
def main(argv=None):
    args = parse_args("train_multi_gpu_using_launch", __doc__.splitlines()[0], argv)
    launched = launcher_environment()
    if launched is None:
        print("Not started by torchrun or SLURM: training in one process (see --help for the torchrun command).")
    plan = prepare(args, world_size=launched["world_size"] if launched else 1)
    process = init_distributed_mode(args.device, args.dist_backend, args.dist_url, args.dist_timeout)
    try:
        train(args, plan, process)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
