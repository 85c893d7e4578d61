"""Train ResNet-34 in one process on one device (a GPU, or the CPU when there is none).

python train_single_gpu.py --demo
python train_single_gpu.py --data-path flower_photos --device cuda:0
"""

from multi_train_utils.distributed_utils import init_single_process
from training import parse_args, prepare, train
from utils import entry_point


@entry_point
def main(argv=None):
    args = parse_args("train_single_gpu", __doc__.splitlines()[0], argv)
    split = prepare(args, world_size=1)
    init_single_process(args)  # no process group: rank 0 of a world of one, on the chosen device
    train(args, split)


if __name__ == "__main__":
    main()
