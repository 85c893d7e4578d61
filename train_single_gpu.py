"""Train ResNet-34 in one process on one device (a GPU, or the CPU when there is none).

python train_single_gpu.py --demo
python train_single_gpu.py --data-path flower_photos --device cuda:0
"""

from flags import parse_args, prepare
from multi_train_utils.distributed_utils import single_process
from training import train
from utils import entry_point


@entry_point
def main(argv=None):
    args = parse_args("train_single_gpu", __doc__.splitlines()[0], argv)
    plan = prepare(args, world_size=1)
    train(args, plan, single_process(args.device))  # no process group: rank 0 of a world of one


if __name__ == "__main__":
    main()
