"""The training scripts' wiring, for the tests that check its properties piece by piece: the loaders and the model
of train_multi_gpu_using_launch.py's `train` (train_single_gpu.py's, for the single-process model), built by the
very statements that `train` runs. Each block between "statement for statement" and "end of" lines is the script's
own, token for token: tests/test_wiring.py fails when the two differ. And the small networks the step-by-step tests
put in create_model's place (resnet10), and a build kept to be copied (built_once)."""

import copy
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchvision.models.resnet import BasicBlock, ResNet

from model import data_parallel_over_gpus, initial_model
from multi_train_utils.distributed_utils import Process, shuffled_batches, val_shard
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Training
from my_dataset import EpochsAhead, TrainingBatches, ValidationBatches, datasets, loader_options
from recipe.config import Config
from recipe.loss import build_objective
from recipe.optimizer import build_optimizer, model_ema
from recipe.precision import Compute

CPU = torch.device("cpu")


def loaders(
    split, img_size: int, batch_size: int, seed: int, world_size=1, rank=0, workers=0, compute=Compute(), **augment
):
    """(training loader, validation loader) of process `rank` of `world_size`, with `workers` loader workers and
    the augmentation flags `augment` (auto_augment, random_erase); with compute.on_device, the batches made on the
    device (the CPU) instead."""
    config = Config(img_size=img_size, batch_size=batch_size, seed=seed, **augment)
    plan, process, device = SimpleNamespace(split=split), Process(rank, world_size), CPU
    # statement for statement: train_multi_gpu_using_launch.py
    train_set, val_set, decoded = datasets(plan.split, config, process)
    # end of train_multi_gpu_using_launch.py
    # statement for statement: train_multi_gpu_using_launch.py
    loading = loader_options(workers, config, device)
    batches = shuffled_batches(train_set, config.batch_size, config.seed, process.rank, process.world_size)
    val_sampler = val_shard(val_set, process.rank, process.world_size)
    if compute.on_device:
        train_loader = TrainingBatches(train_set, batches, device, compute.memory_format)
        val_loader = ValidationBatches(val_set, val_sampler, config.batch_size, device)
    else:
        train_loader = EpochsAhead(DataLoader(train_set, batch_sampler=batches, **loading), config.epochs)
        val_loader = EpochsAhead(DataLoader(val_set, batch_size=config.batch_size, sampler=val_sampler, **loading))
    # end of train_multi_gpu_using_launch.py
    return train_loader, val_loader


def model_as_trained(
    num_classes: int, compute: Compute = Compute(), sync_bn=False, distributed=False, compile=False, **options
):
    """(the model as it is trained: in DDP wrapped, with SyncBatchNorm when `sync_bn`; compiled when `compile`,
    the model itself, for evaluating and saving): ResNet-34 (or options["model"]), seeded with 0, on the CPU (or
    options["device"]); other `options` are Config fields."""
    device = options.pop("device", CPU)
    config = Config(model=options.pop("model", "resnet34"), seed=0, sync_bn=sync_bn, compile=compile, **options)
    plan = SimpleNamespace(split=SimpleNamespace(classes=range(num_classes)), weights=None)
    if distributed:
        # statement for statement: train_multi_gpu_using_launch.py
        model = initial_model(
            config.model, len(plan.split.classes), device, compute.memory_format,
            seed=config.seed, weights=plan.weights, freeze=config.freeze_layers,
            grad_checkpointing=config.grad_checkpointing,
        )  # fmt: skip
        if config.sync_bn and not config.freeze_layers:
            model = convert_sync_batchnorm(model)
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        trained = torch.compile(trained) if config.compile else trained
        # end of train_multi_gpu_using_launch.py
    else:
        # statement for statement: train_single_gpu.py
        model = initial_model(
            config.model, len(plan.split.classes), device, compute.memory_format,
            seed=config.seed, weights=plan.weights, freeze=config.freeze_layers,
            grad_checkpointing=config.grad_checkpointing,
        )  # fmt: skip
        trained = data_parallel_over_gpus(model, device) if config.data_parallel else model
        trained = torch.compile(trained) if config.compile else trained
        # end of train_single_gpu.py
    return trained, model


def training_as_built(config: Config, plan, trained, model, train_loader, device, compute: Compute) -> Training:
    """The Training of train_single_gpu.py's `train` (its optimizer, schedule, gradient scaler, loss and EMA) for
    `trained` (and its unwrapped `model`), a run of `config` on `plan.split` (its classes and train_labels) on
    `device` as `compute` says, with `train_loader`'s batches an epoch."""
    # statement for statement: train_single_gpu.py
    optimizer, scheduler = build_optimizer(trained, config, len(train_loader))
    training = Training(
        trained, optimizer, scheduler, compute, compute.grad_scaler(device),
        objective=build_objective(config, plan.split, device), accumulate=config.accumulate,
        clip_grad_norm=config.clip_grad_norm, ema=model_ema(model, config.ema_decay) if config.model_ema else None,
    )  # fmt: skip
    # end of train_single_gpu.py
    return training


def resnet10(num_classes, name=None, norm_layer=None):
    """A ResNet of one block a stage (torchvision's ResNet class, as --model resnet18 builds it, with half its
    blocks): every kind of layer of the default ResNet-34 (convolutions, BatchNorm, the shortcuts' downsampling, the
    head) in 4.9 M weights, half of ResNet-18's. The tests whose proofs do not depend on the depth (float64 step
    comparisons, fake-CUDA steps) put it in create_model's place."""
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm_layer)


def group_norm_resnet10(num_classes, name=None):
    """The same network normalising each image alone (GroupNorm): no statistic crosses images."""
    return resnet10(num_classes, norm_layer=lambda channels: nn.GroupNorm(8, channels))


def built_once(create):
    """`create`, each network built once and copied after: create(num_classes, *args) for each argument list and
    default dtype (initial_model seeds every build alike, and a large or float64 network takes a while to
    initialise; a copy is a fraction of that)."""
    built = {}

    def copy_of(num_classes, *args):
        key = (num_classes, *args, torch.get_default_dtype())
        if key not in built:
            built[key] = create(num_classes, *args)
        return copy.deepcopy(built[key])

    return copy_of
