"""Gradient checkpointing: each block's activations recomputed in the backward pass, for any model whose blocks are
known (timm's say so themselves), BatchNorm's running statistics updated once."""

import types

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from network.architectures import TIMM, is_timm
from utils import UserError

# --- gradient checkpointing --------------------------------------------------------------------------------------

# torchvision's families whose blocks are known: the nn.Sequential(s) that hold them, one block after another.
FEATURES = ("AlexNet", "ConvNeXt", "DenseNet", "EfficientNet", "MobileNetV2", "MobileNetV3", "SqueezeNet", "VGG")
BLOCK_SEQUENCES = {
    "ResNet": ("layer1", "layer2", "layer3", "layer4"),
    "RegNet": ("trunk_output",),
    "ShuffleNetV2": ("stage2", "stage3", "stage4"),
    "MNASNet": ("layers",),
    "VisionTransformer": ("encoder.layers",),
    **dict.fromkeys(("SwinTransformer", *FEATURES), ("features",)),
}


def enable_grad_checkpointing(model: nn.Module, name: str) -> nn.Module:
    """Make `model` (torchvision's or timm's `name`) keep only each block's input from the forward pass and
    recompute the block's activations in the backward pass: less memory for one more forward pass of each block.

    torch's non-reentrant checkpoint (use_reentrant=False), which DDP and no_sync take as any backward pass, and
    which restores the random state for the recomputation (preserve_rng_state), so dropout and stochastic depth
    draw the same masks again: the gradients are those of the plain model. timm's models checkpoint their own
    blocks (set_grad_checkpointing); torchvision's have theirs wrapped here, in the sequences BLOCK_SEQUENCES names.
    Parameter names, and so weights files, stay as they are. UserError where no blocks are known.

    The recomputation would update BatchNorm's running statistics a second time (torch's checkpoint does not
    know BatchNorm: pytorch/pytorch#96136): they are frozen from the end of each training forward pass until its
    backward pass has computed every gradient (hooks on `model` and its parameters), so a step updates them once,
    as without checkpointing.
    """
    if is_timm(name):
        from timm.layers import set_reentrant_ckpt

        set_reentrant_ckpt(False)  # non-reentrant, whatever TIMM_REENTRANT_CKPT says
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError, AttributeError) as refusal:
            raise UserError(
                f"--grad-checkpointing: timm's {name.removeprefix(TIMM)} does not support it ({refusal})"
            ) from None
    else:
        paths = BLOCK_SEQUENCES.get(type(model).__name__)
        if paths is None:
            known = ", ".join(sorted(BLOCK_SEQUENCES))
            raise UserError(
                f"--grad-checkpointing: {name}'s blocks are not known here (they are for torchvision's {known}, "
                f"and for timm's models)"
            )
        for path in paths:
            checkpoint_blocks(model.get_submodule(path))
    model.register_forward_hook(running_statistics_off)
    model.register_forward_pre_hook(running_statistics_on)  # if no backward pass came after the last forward pass
    return model


def checkpoint_blocks(sequence: nn.Sequential) -> None:
    """Run `sequence`'s children in checkpointed runs: each child with parameters (a block, or a single layer
    such as a convolution) starts a run, and the parameterless layers after it (activation, pooling) join it. A
    child that is itself a plain sequence of blocks (a stage) checkpoints its own blocks instead. A run that
    would start with an in-place layer, which would change the input kept for its recomputation, is not
    checkpointed. Its forward is replaced on the instance: the children, and so the parameter names, stay."""
    runs = []  # (checkpointed?, the names of the children it runs)
    for child_name, child in sequence.named_children():
        if is_sequence_of_blocks(child):
            checkpoint_blocks(child)
            runs.append((False, [child_name]))
        elif runs and runs[-1][0] and not any(True for _ in child.parameters()):
            runs[-1][1].append(child_name)
        else:
            runs.append((not getattr(child, "inplace", False), [child_name]))
    sequence.checkpointed_runs = runs
    sequence.forward = types.MethodType(forward_in_checkpointed_runs, sequence)


def is_sequence_of_blocks(module: nn.Module) -> bool:
    """A stage: an nn.Sequential that runs its children in order and whose every child has children itself."""
    children = list(module.children())
    return (
        isinstance(module, nn.Sequential)
        and type(module).forward is nn.Sequential.forward
        and bool(children)
        and all(any(True for _ in child.children()) for child in children)
    )


def forward_in_checkpointed_runs(self: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """nn.Sequential's forward, each run of checkpoint_blocks recomputed in the backward pass."""
    for checkpointed, names in self.checkpointed_runs:
        layers = [self._modules[name] for name in names]  # looked up each time: SyncBatchNorm replaces layers
        if checkpointed and torch.is_grad_enabled():
            x = checkpoint(run_layers, layers, x, use_reentrant=False, preserve_rng_state=True)
        else:
            x = run_layers(layers, x)
    return x


def run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def running_statistics_on(model: nn.Module, *forward_args) -> None:
    """The BatchNorm layers that running_statistics_off froze update their statistics again, their count of
    batches as it was at the end of the forward pass (a hook: after the backward pass, before a forward pass)."""
    for layer in model.modules():
        if hasattr(layer, "momentum_while_frozen"):
            layer.momentum = layer.__dict__.pop("momentum_while_frozen")
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(layer.__dict__.pop("batches_while_frozen"))


def running_statistics_off(model: nn.Module, args, output) -> None:
    """Forward hook: after a training forward pass, each BatchNorm layer keeps its running statistics as they are
    (momentum 0: an update leaves them; its count of batches, kept aside, is put back after) until the backward
    pass has computed every gradient, its recomputations done: then running_statistics_on, before anything reads
    them (the EMA, a checkpoint). (Not track_running_stats=False: BatchNorm would then save other tensors for its
    backward pass than in the forward pass, which the checkpoint refuses.)"""
    if not (model.training and torch.is_grad_enabled()):
        return
    for layer in model.modules():
        if isinstance(layer, _BatchNorm) and layer.track_running_stats and not hasattr(layer, "momentum_while_frozen"):
            layer.momentum_while_frozen, layer.momentum = layer.momentum, 0.0
            if layer.num_batches_tracked is not None:
                layer.batches_while_frozen = layer.num_batches_tracked.clone()  # on the device: nothing waits
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if trained:  # a hook of this backward pass alone (a parameter's hooks go when .to() replaces its data)

        def backward_done(gradients) -> None:
            running_statistics_on(model)
            handle.remove()

        handle = register_multi_grad_hook(trained, backward_done, mode="all")
