"""Gradient checkpointing: each block's activations recomputed in the backward pass, for any model whose blocks are
known (timm's say so themselves), BatchNorm's running statistics still updated once a step."""

import types

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from network.architectures import TIMM, is_timm
from utils import UserError

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
    """Make `model` keep only each block's input and recompute its activations in the backward pass: less memory
    for one more forward pass. Non-reentrant (DDP and no_sync take it as any backward pass), the random state
    restored so dropout draws the same masks: the plain model's gradients. timm's models checkpoint their own
    blocks; torchvision's have those BLOCK_SEQUENCES names wrapped here, parameter names unchanged. UserError where
    no blocks are known. BatchNorm's running statistics are frozen from each training forward pass to the end of
    its backward pass, so that the recomputation does not update them again (pytorch/pytorch#96136)."""
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
    """Run `sequence`'s children in checkpointed runs: each child with parameters starts one, the parameterless
    layers after it (activation, pooling) join it; a stage checkpoints its own blocks instead; a run starting with
    an in-place layer (which would change the input kept) is not checkpointed. Only the forward is replaced."""
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
    """A stage: a plain nn.Sequential whose every child has children itself."""
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
    """The BatchNorm layers running_statistics_off froze update their statistics again, their count of batches
    as at the end of the forward pass (after the backward pass, or before the next forward pass)."""
    for layer in model.modules():
        if hasattr(layer, "momentum_while_frozen"):
            layer.momentum = layer.__dict__.pop("momentum_while_frozen")
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(layer.__dict__.pop("batches_while_frozen"))


def running_statistics_off(model: nn.Module, args, output) -> None:
    """After a training forward pass, each BatchNorm layer keeps its running statistics (momentum 0, its count of
    batches kept aside) until the backward pass has computed every gradient. (Not track_running_stats=False:
    BatchNorm would then save other tensors for its backward pass, which the checkpoint refuses.)"""
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
