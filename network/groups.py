"""Parameter groups: layer-wise learning-rate decay (the order of a model's layers), the decay of norms and biases."""

from torch import nn

from network.architectures import TIMM, is_timm
from network.checkpointing import FEATURES
from utils import UserError

# torchvision's families whose layers run in a known order, from the input: each entry one layer ("a b": a and b
# together; "x.*": each child of x that has parameters, one layer each). Every parameter after them is the head's.
LAYERS = {
    "ResNet": ("conv1 bn1", "layer1", "layer2", "layer3", "layer4"),
    "RegNet": ("stem", "trunk_output.*"),
    "ShuffleNetV2": ("conv1", "stage2", "stage3", "stage4", "conv5"),
    "MNASNet": ("layers.*",),
    "VisionTransformer": ("conv_proj class_token encoder.pos_embedding", "encoder.layers.*"),
    **dict.fromkeys(("SwinTransformer", *FEATURES), ("features.*",)),
}
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)


def layer_scales(model: nn.Module, name: str, layer_decay: float) -> dict[str, float]:
    """Each parameter's share of the learning rate: the head's 1, each layer before `layer_decay` times the next's."""
    if is_timm(name):
        from timm.optim import param_groups_layer_decay

        if not hasattr(model, "group_matcher"):
            raise UserError(f"--layer-decay: timm's {name.removeprefix(TIMM)} does not say the order of its layers")
        groups = param_groups_layer_decay(model, weight_decay=0.0, layer_decay=layer_decay)
        scale_of = {id(parameter): group["lr_scale"] for group in groups for parameter in group["params"]}
        return {key: scale_of.get(id(parameter), 1.0) for key, parameter in model.named_parameters()}
    layers = LAYERS.get(type(model).__name__)
    if layers is None:
        raise UserError(f"--layer-decay: the order of {name}'s layers is not known here (it is for torchvision's "
                        f"{', '.join(sorted(LAYERS))}, and for timm's models)")  # fmt: skip
    prefixes = []  # each layer's prefixes, from the input
    for layer in layers:
        if layer.endswith(".*"):
            parent = layer.removesuffix(".*")
            children = model.get_submodule(parent).named_children()
            prefixes += [[f"{parent}.{child}"] for child, module in children if any(True for _ in module.parameters())]
        else:
            prefixes.append(layer.split())
    scales = {}
    for key, _ in model.named_parameters():
        depth = next((i for i, layer in enumerate(prefixes) for p in layer if f"{key}.".startswith(f"{p}.")), None)
        scales[key] = 1.0 if depth is None else layer_decay ** (len(prefixes) - depth)
    return scales


def norms_and_biases(model: nn.Module, name: str) -> frozenset[str]:
    """The names of the parameters --norm-weight-decay applies to: norms' weights and biases (timm's models: timm's)."""
    if is_timm(name):
        from timm.optim import param_groups_weight_decay

        exempt = getattr(model, "no_weight_decay", set)()
        groups = param_groups_weight_decay(model, weight_decay=1.0, no_weight_decay_list=exempt)
        without = {id(parameter) for group in groups if group["weight_decay"] == 0 for parameter in group["params"]}
        return frozenset(key for key, parameter in model.named_parameters() if id(parameter) in without)
    found = {key for key, _ in model.named_parameters() if key.rpartition(".")[2] == "bias"}
    for prefix, layer in model.named_modules():
        if isinstance(layer, NORMS):
            found |= {f"{prefix}.{key}" if prefix else key for key, _ in layer.named_parameters(recurse=False)}
    return frozenset(found)
