"""Train ResNet-34 (or any torchvision classifier) in one process on one device: a GPU, or the CPU when there is
none.

    python train_single_gpu.py --demo
    python train_single_gpu.py --data-path flower_photos --device cuda:0

This is the baseline the two DDP scripts are read against: `diff train_single_gpu.py
train_multi_gpu_using_launch.py` shows what DistributedDataParallel changes, each changed line saying why.
"""

import time

import torch

from autotune.choose import choose
from model import data_parallel_over_gpus, initial_model
from multi_train_utils.bookkeeping import unreadable_limits
from multi_train_utils.distributed_utils import shuffled_batches, single_process
from multi_train_utils.stop_and_resume import resume_from, saving_a_step_on_stop
from multi_train_utils.train_eval_utils import Training, train_one_epoch, validate
from my_dataset import datasets, loaders
from recipe.loss import build_objective
from recipe.optimizer import build_optimizer, model_ema
from run.config import parse_config
from run.metrics import best_so_far, epoch_metrics
from run.plan import announce, prepare
from run.run_log import RunLog
from utils import entry_point


@entry_point
def main(argv=None):
    config = parse_config("train_single_gpu", __doc__.splitlines()[0], argv)
    config, plan = prepare(config, world_size=1)
    process = single_process(config.device)  # no process group: rank 0 of a world of one
    train(config, plan, process)


def train(config, plan, process) -> dict:
    """Train and validate in this process for config.epochs epochs; returns the last epoch's metrics."""
    device = process.device
    # The images, mapped from the image store (decoded once by the first run; --store-dir): an epoch only crops them
    train_set, val_set = datasets(plan, config)
    # What the flags leave to auto is measured on this machine's cores, or remembered from a run: autotune/choose.py
    choice = choose(config, plan, device, 1, train_set)
    announce(config, plan, process, choice)

    # The data: every epoch a new seeded shuffle of all the training images, in batches
    batches = shuffled_batches(train_set, config.batch_size, config.seed)
    val_sampler = range(len(val_set))  # the validation images in order
    # Made on the device from the images held there, or by loader processes, as auto chose (--batches)
    train_loader, val_loader = loaders(train_set, val_set, batches, val_sampler, config, choice, device)

    # The model, its initial weights seeded
    model = initial_model(
        config.model, len(plan.split.classes), device, choice.memory_format, seed=config.seed, weights=plan.weights,
        freeze=config.freeze_layers, grad_checkpointing=config.grad_checkpointing,
    )  # fmt: skip
    trained = data_parallel_over_gpus(model, device) if config.data_parallel else model
    trained = torch.compile(trained) if config.compile else trained

    # The recipe
    optimizer, scheduler = build_optimizer(model, config, len(train_loader))
    training = Training(
        trained, optimizer, scheduler, choice, choice.grad_scaler(device),
        objective=build_objective(config, plan.split, device), accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm, ema=model_ema(model, config.ema_decay) if config.model_ema else None,
    )  # fmt: skip
    start_epoch, best_acc = resume_from(plan.resume, model, training, config.epochs)

    log, metrics = RunLog(config, plan, process, choice, val_set, start_epoch, best_acc), {}
    expected = (len(train_loader) * config.batch_size * process.world_size, len(val_set))  # an epoch's images
    limits = unreadable_limits(*expected, config.strict_images)
    with saving_a_step_on_stop(log, model, training):  # a stop signal (SIGTERM, SIGUSR1) ends at a step, saved
        for epoch in range(start_epoch, config.epochs):
            batches.set_epoch(epoch)  # a new shuffle (and new augmentation) every epoch
            lr, start = training.epoch_lr(), training.epoch_start()
            trained_epoch = train_one_epoch(training, train_loader, device, epoch, limits[0])
            train_seconds = time.perf_counter() - start
            confusion, ema_metrics = validate(model, training, val_loader, device, len(plan.split.classes), limits[1])
            seconds = (train_seconds, time.perf_counter() - start)
            metrics = epoch_metrics(epoch, lr, trained_epoch, seconds, confusion, expected, process) | ema_metrics
            best, best_acc = best_so_far(metrics, model, training.ema, best_acc)
            log.epoch(metrics, model, training, best, best_acc)
    log.done(best_acc)
    return metrics


if __name__ == "__main__":
    main()
