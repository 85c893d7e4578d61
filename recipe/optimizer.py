"""The optimizer and its learning-rate schedule (a linear warmup, then a half cosine), its parameter groups (layer-wise
learning-rate decay, the weight decay of norms and biases), and the weights' moving average (EMA): torch's own SGD,
AdamW, LambdaLR and swa_utils.AveragedModel, combined so that every option means the same on one process and on
eight."""

import functools
import math

import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from network.architectures import unwrapped
from network.groups import layer_scales, norms_and_biases


def build_optimizer(model, config, batches_per_epoch: int, world_size: int = 1):
    """The optimizer over the trainable parameters, and its schedule, stepped after every optimizer step: a
    linear warmup over --warmup-epochs, then a half cosine from the full rate down to rate * --lrf.

    The full rate is --lr times the batches of --batch-size images a step averages over: `world_size` processes,
    each summing --accumulate batches (the linear scaling rule: a global batch that many times larger); an
    epoch of `batches_per_epoch` batches takes that many optimizer steps, the last with what is left.
    `config` is a Config (lr, opt, momentum, weight_decay, epochs, lrf, warmup_epochs, accumulate, batch_size,
    model, layer_decay, norm_weight_decay). With --layer-decay or --norm-weight-decay the parameters are in groups
    (parameter_groups), each with its own share of the rate, which the schedule scales (LambdaLR multiplies each
    group's own initial rate).
    """
    rate = learning_rate(config, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = parameter_groups(model, config, rate)
    # fused: the update of every parameter in one kernel (the optimizer step of ResNet-34 2.6x faster than torch's
    # default on a CPU, docs/performance.md); and float16's gradient scaler then skips an overflowed step on the
    # device, where with another optimizer the host reads whether one overflowed, waiting for the device each step
    if config.opt == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=rate, weight_decay=config.weight_decay, fused=True)
    else:
        optimizer = torch.optim.SGD(
            groups, lr=rate, momentum=config.momentum, weight_decay=config.weight_decay, fused=True
        )
        # torch's fused SGD makes its momentum buffers with empty_like at its first step: a first step that float16's
        # scaler skips (an overflow, usual then) leaves them unset, and the next step reads garbage. Made zeros here,
        # the first step is the same (0 x momentum + gradient), and a skipped one leaves them as they were.
        for param in params if config.momentum else []:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
    factor = functools.partial(
        schedule_factor,
        steps_per_epoch=math.ceil(batches_per_epoch / config.accumulate),
        epochs=config.epochs,
        warmup_epochs=config.warmup_epochs,
        lrf=config.lrf,
    )
    return optimizer, lr_scheduler.LambdaLR(optimizer, factor)


def parameter_groups(model, config, rate: float) -> list:
    """The trainable parameters of `model` (wrapped or not), as the optimizer takes them: one list, or, with
    --layer-decay or --norm-weight-decay, groups of the parameters that share a rate and a weight decay.

    --layer-decay F: each parameter's rate is `rate` times its layer's share (model.layer_scales: the head's 1,
    each layer before it F times the next one's). --norm-weight-decay X: the norm layers' weights and the biases
    (model.norms_and_biases) decay by X, the others by --weight-decay. The groups come in order of rate, the head's
    first: param_groups[0] has the schedule's full rate, which a run reports as its learning rate.
    """
    if config.layer_decay == 1 and config.norm_weight_decay is None:
        return [p for p in model.parameters() if p.requires_grad]
    network = unwrapped(model)  # the names without DDP's or torch.compile's prefixes
    scales = layer_scales(network, config.model, config.layer_decay) if config.layer_decay != 1 else {}
    norms = norms_and_biases(network, config.model) if config.norm_weight_decay is not None else frozenset()
    groups = {}
    for name, parameter in network.named_parameters():
        if parameter.requires_grad:
            lr = rate * scales.get(name, 1.0)
            decay = config.norm_weight_decay if name in norms else config.weight_decay
            groups.setdefault((lr, decay), {"params": [], "lr": lr, "weight_decay": decay})["params"].append(parameter)
    return sorted(groups.values(), key=lambda group: -group["lr"])


def learning_rate(config, world_size: int = 1) -> float:
    """The full rate: --lr times the batches a step averages over (`world_size` processes, --accumulate each)."""
    return config.lr * world_size * config.accumulate


def describe_learning_rate(config, world_size: int = 1) -> str:
    """The line a run prints about its rate, e.g. "Learning rate 0.002 (--lr 0.001 x 1 process(es) x 2
    batch(es)) for a global batch of 16"."""
    global_batch = config.batch_size * world_size * config.accumulate
    return (
        f"Learning rate {learning_rate(config, world_size):g} (--lr {config.lr:g} x {world_size} process(es) x "
        f"{config.accumulate} batch(es)) for a global batch of {global_batch}"
    )


def schedule_factor(step: int, *, steps_per_epoch: int, epochs: int, warmup_epochs: int, lrf: float) -> float:
    """The learning rate at optimizer step `step` (counted from 0 over the run) as a share of the full rate.

    Warmup: 1/W, 2/W, ..., 1 over its W steps. Then the cosine: 1 at the first step after warmup, falling to lrf
    at the end of the last epoch; without warmup, each epoch starts at (1 + cos(pi * epoch / epochs)) / 2 of the
    way from lrf to 1.
    """
    warmup = warmup_epochs * steps_per_epoch
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, epochs * steps_per_epoch - warmup)
    return lrf + (1 - lrf) * (1 + math.cos(math.pi * min(progress, 1.0))) / 2


def model_ema(model: nn.Module, decay: float) -> AveragedModel:
    """An exponential moving average of `model`'s weights and buffers (BatchNorm's running statistics included):
    after each optimizer step, average = decay * average + (1 - decay) * weights; the first step copies them."""
    return ExponentialMovingAverage(model, decay)


class ExponentialMovingAverage(AveragedModel):
    """torch's AveragedModel with its exponential average (get_ema_multi_avg_fn) over weights and buffers, and an
    update that never makes the host wait for the device: AveragedModel.update_parameters copies its count of
    updates, a CPU tensor, to the device at every step (a blocking copy, for an average that does not use it).
    The same state_dict, so checkpoints load either way."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """The first update copies `model`'s weights and buffers; each later one averages those in floating point
        and copies the others (BatchNorm's counts of batches)."""
        ours, theirs_now = [*self.module.parameters(), *self.module.buffers()], [*model.parameters(), *model.buffers()]
        averaged, current, copies = [], [], []
        first = int(self.n_averaged) == 0  # on the CPU: read without waiting for the device
        for mine, theirs in zip(ours, theirs_now, strict=True):
            if first or not mine.is_floating_point():
                copies.append((mine, theirs))
            else:
                averaged.append(mine)
                current.append(theirs.detach())
        for mine, theirs in copies:
            mine.copy_(theirs)
        if averaged:
            self.multi_avg_fn(averaged, current, self.n_averaged)
        self.n_averaged += 1
