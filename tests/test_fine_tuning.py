"""The fine-tuning controls and timm's models, each against what it says it does: --clip-grad-norm clips the total
norm to MAX in the gradients' true units (float16's scaling undone first); --norm-weight-decay gives the norm layers'
weights and the biases their own decay; --layer-decay gives each layer its share of the rate by depth (ResNet's
stages, a ViT's blocks, timm's own layers), which the schedule keeps; --grad-checkpointing recomputes the blocks and
leaves the gradients and BatchNorm's statistics as they were, in float64; `--model timm/NAME` trains, stops and
resumes as the uninterrupted run; and what is refused is one line.

Everything runs in this process, on tiny models and 32 px images (timm's test_* models are made for tests). All but
the last test are in the fast tier: they start no script and train no run."""

import copy
import importlib

import pytest
import timm
import torch
from conftest import FAST, assert_user_error, final_weights, metrics_without_timings
from test_host_syncs import TwoRanks
from torch import nn
from torchvision.models import efficientnet_b0, resnet18

from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.train_eval_utils import Training, optimizer_step
from network.architectures import create_model, model_skeleton
from network.checkpointing import enable_grad_checkpointing
from network.groups import layer_scales, norms_and_biases
from recipe.optimizer import build_optimizer
from run.config import Config

# --clip-grad-norm ------------------------------------------------------------------------------------------------


def clipped_step(gradients: list[torch.Tensor], max_norm: float, scaler=None) -> list[torch.Tensor]:
    """The gradients optimizer_step applies for `gradients` (as backward left them: scaled, with a scaler) with
    --clip-grad-norm `max_norm`: plain SGD at rate 1 moves each parameter by exactly its gradient."""
    parameters = [nn.Parameter(torch.zeros_like(gradient)) for gradient in gradients]
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient.clone()
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    scaler = scaler or torch.amp.GradScaler("cpu", enabled=False)
    optimizer_step(Training(nn.Module(), optimizer, clip_grad_norm=max_norm), scaler)
    return [-parameter.detach() for parameter in parameters]


def total_norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])).item()


@pytest.mark.fast
def test_clipping_scales_a_larger_total_norm_down_to_max_and_leaves_a_smaller_one():
    gradients = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]])]  # total norm 5, over two parameters
    clipped = clipped_step(gradients, max_norm=2.0)
    assert total_norm(clipped) == pytest.approx(2.0, rel=1e-5)
    assert torch.allclose(clipped[0], gradients[0] * 2 / 5) and torch.allclose(clipped[1], gradients[1] * 2 / 5)
    assert all(torch.equal(a, b) for a, b in zip(clipped_step(gradients, max_norm=6.0), gradients, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(clipped_step(gradients, max_norm=0.0), gradients, strict=True))


@pytest.mark.fast
def test_under_a_gradient_scaler_the_clipped_norm_is_max_in_the_gradients_true_units():
    scale = 2.0**16
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # the scale is made at the first loss it scales
    true = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]])]
    clipped = clipped_step([gradient * scale for gradient in true], max_norm=2.0, scaler=scaler)
    # clipped before unscaling, the step would be 2 / 65536 long
    assert total_norm(clipped) == pytest.approx(2.0, rel=1e-5)
    assert scaler.get_scale() == scale  # no overflow: the scale stays


@pytest.mark.fast
def test_an_overflowed_step_under_a_scaler_is_skipped_with_clipping_on_not_raised():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    step = clipped_step([torch.tensor([float("inf"), 1.0])], max_norm=1.0, scaler=scaler)
    assert torch.equal(step[0], torch.zeros(2))  # nothing moved
    assert scaler.get_scale() == 512.0  # and the scale came down, as for any overflow


# --norm-weight-decay and --layer-decay ---------------------------------------------------------------------------


def groups_by_name(network: nn.Module, **recipe) -> dict[str, dict]:
    """Each trainable parameter's optimizer group (its lr and weight_decay), by name, as build_optimizer makes them
    for `network` and the Config fields `recipe` (SGD at --lr 0.1, weight decay 1e-4 unless given)."""
    config = Config(**{"lr": 0.1, "weight_decay": 1e-4, "epochs": 2, **recipe})
    optimizer, _ = build_optimizer(network, config, batches_per_epoch=3)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {name: group_of[id(p)] for name, p in network.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def network():
    return resnet18(num_classes=5)


@pytest.mark.fast
def test_norm_weights_and_biases_take_norm_weight_decay_and_the_other_weights_weight_decay(network):
    groups = groups_by_name(network, model="resnet18", norm_weight_decay=0.0)
    norms = {name for name, module in network.named_modules() if isinstance(module, nn.BatchNorm2d)}
    for name, group in groups.items():
        is_norm_or_bias = name.rpartition(".")[0] in norms or name.endswith(".bias")
        assert group["weight_decay"] == (0.0 if is_norm_or_bias else 1e-4), name
    assert groups["fc.bias"]["weight_decay"] == 0.0 and groups["layer1.0.conv1.weight"]["weight_decay"] == 1e-4
    assert {group["lr"] for group in groups.values()} == {0.1}  # the rate as it was


@pytest.mark.fast
def test_without_the_options_there_is_one_group_as_before(network):
    optimizer, _ = build_optimizer(network, Config(lr=0.1, weight_decay=1e-4, epochs=2), batches_per_epoch=3)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["params"] == list(network.parameters())


STAGES = ("conv1", "layer1", "layer2", "layer3", "layer4", "fc")  # a ResNet's stem, stages and head, in order


def stage(parameter: str) -> str:
    first = parameter.split(".")[0]
    return "conv1" if first == "bn1" else first  # the stem: its convolution(s) and their BatchNorm


@pytest.mark.fast
@pytest.mark.parametrize("name", ["resnet18", "timm/test_resnet"])
def test_layer_decay_gives_the_head_the_full_rate_and_each_stage_before_it_f_times_the_next(name):
    model = create_model(5, name)
    for parameter, group in groups_by_name(model, model=name, layer_decay=0.5).items():
        depth = STAGES.index(stage(parameter))
        assert group["lr"] == pytest.approx(0.1 * 0.5 ** (len(STAGES) - 1 - depth)), parameter


@pytest.mark.fast
def test_the_schedule_scales_each_groups_own_rate_and_the_first_group_is_the_heads(network):
    config = Config(model="resnet18", lr=0.1, epochs=2, weight_decay=0.0, layer_decay=0.5, opt="adamw")
    optimizer, scheduler = build_optimizer(network, config, batches_per_epoch=3)
    assert optimizer.defaults["fused"]  # one kernel for every group
    initial = [group["lr"] for group in optimizer.param_groups]
    assert initial[0] == pytest.approx(0.1) and initial == sorted(initial, reverse=True)
    optimizer.step()
    scheduler.step()
    factor = optimizer.param_groups[0]["lr"] / initial[0]
    assert 0 < factor < 1
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([rate * factor for rate in initial])


@pytest.mark.fast
def test_layer_decay_and_norm_weight_decay_combine(network):
    groups = groups_by_name(network, model="resnet18", layer_decay=0.5, norm_weight_decay=0.0)
    assert (groups["layer3.0.bn1.weight"]["lr"], groups["layer3.0.bn1.weight"]["weight_decay"]) == (
        pytest.approx(0.1 * 0.25),
        0.0,
    )
    assert (groups["layer3.0.conv1.weight"]["lr"], groups["layer3.0.conv1.weight"]["weight_decay"]) == (
        pytest.approx(0.1 * 0.25),
        1e-4,
    )
    assert (groups["fc.weight"]["lr"], groups["fc.bias"]["weight_decay"]) == (pytest.approx(0.1), 0.0)


@pytest.mark.fast
def test_a_vits_layers_are_its_embedding_then_each_block_then_the_head():
    torchvision_vit = model_skeleton("vit_b_16")  # without memory: only the names count
    scales = layer_scales(torchvision_vit, "vit_b_16", 0.5)
    assert scales["heads.head.weight"] == scales["encoder.ln.weight"] == 1
    assert scales["encoder.layers.encoder_layer_11.mlp.0.weight"] == 0.5
    assert scales["encoder.layers.encoder_layer_0.ln_1.weight"] == 0.5**12
    assert scales["conv_proj.weight"] == scales["class_token"] == scales["encoder.pos_embedding"] == 0.5**13
    timm_vit = model_skeleton("timm/test_vit")  # 6 blocks; timm's own grouping (group_matcher)
    scales = layer_scales(timm_vit, "timm/test_vit", 0.5)
    assert scales["head.weight"] == 1 and scales["blocks.5.mlp.fc1.weight"] == 0.5
    assert scales["blocks.0.attn.qkv.weight"] == 0.5**6 and scales["patch_embed.proj.weight"] == scales["cls_token"]
    assert scales["cls_token"] == 0.5**7


@pytest.mark.fast
def test_a_timm_models_norms_and_biases_are_timms_choice():
    model = model_skeleton("timm/test_vit")
    chosen = norms_and_biases(model, "timm/test_vit")
    assert {"pos_embed", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "head.bias"} <= chosen
    assert chosen == {name for name, p in model.named_parameters() if p.ndim <= 1} | {"pos_embed", "cls_token"}


@pytest.mark.fast
@pytest.mark.parametrize(
    "flags, refusal",
    [
        (
            ("--layer-decay", "0.8", "--model", "googlenet"),
            "--layer-decay: the order of googlenet's layers is not known",
        ),
        (("--grad-checkpointing", "--model", "googlenet"), "--grad-checkpointing: googlenet's blocks are not known"),
        (("--grad-checkpointing", "--model", "timm/inception_v3"), "timm's inception_v3 does not support it"),
        (("--model", "timm/resnet_50"), "timm has no model resnet_50 (close: resnet50"),
        (("--model", "timm/resnet50.b9_in1k"), "timm's resnet50 has no pretrained tag b9_in1k (it has a1_in1k"),
    ],
)
def test_what_a_model_does_not_have_is_refused_in_one_line_before_anything_starts(run_main, tmp_path, flags, refusal):
    result = run_main("train_single_gpu.py", "--data-path", tmp_path, "--output-dir", tmp_path / "out", *flags)
    assert_user_error(result, refusal)
    assert not (tmp_path / "out").exists()


# --grad-checkpointing --------------------------------------------------------------------------------------------


def steps_of(model: nn.Module) -> tuple[dict, dict, int]:
    """The gradients two float64 training passes (forward and backward) sum, the state afterwards (BatchNorm's
    statistics), and how many forward passes the model's convolutions made (each pass draws its dropout and
    stochastic depth from a seed of its own, the same for every model)."""
    model = model.double().train()
    calls = []
    for layer in model.modules():
        if isinstance(layer, nn.Conv2d):
            layer.register_forward_hook(lambda *_: calls.append(1))
    images = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for step in range(2):
        torch.manual_seed(step)
        nn.functional.cross_entropy(model(images[step]), torch.tensor([0, 1, 2, 1])).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    return gradients, model.state_dict(), len(calls)


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, build",
    [  # BatchNorm in each; stochastic depth in the EfficientNets' blocks, whose masks the recomputation draws again
        ("resnet18", lambda: resnet18(num_classes=3)),
        ("efficientnet_b0", lambda: efficientnet_b0(num_classes=3)),
        ("timm/test_efficientnet", lambda: timm.create_model("test_efficientnet", num_classes=3, drop_path_rate=0.3)),
    ],
)
def test_checkpointing_leaves_the_gradients_and_batchnorm_statistics_as_they_were_in_float64(name, build):
    torch.manual_seed(0)
    plain = build()
    checkpointed = enable_grad_checkpointing(copy.deepcopy(plain), name)
    expected_gradients, expected_state, plain_passes = steps_of(plain)
    gradients, state, passes = steps_of(checkpointed)
    assert passes > plain_passes * 1.5  # the blocks' convolutions ran again in the backward pass
    assert gradients.keys() == expected_gradients.keys() and state.keys() == expected_state.keys()  # same names
    for key in expected_gradients:
        torch.testing.assert_close(gradients[key], expected_gradients[key], rtol=0, atol=1e-12, msg=key)
    for key in expected_state:  # running means and variances updated once a step, and the count of batches
        torch.testing.assert_close(state[key], expected_state[key], rtol=0, atol=1e-12, msg=key)
    assert {int(count) for key, count in state.items() if key.endswith("num_batches_tracked")} == {2}  # 2 steps


# timm's models in a run -------------------------------------------------------------------------------------------

TIMM_RUN = (
    *FAST,  # 32 px, batch 8, no measuring; the --model that follows wins
    *("--model", "timm/test_resnet", "--epochs", "2", "--grad-checkpointing", "--clip-grad-norm", "1.0"),
    *("--layer-decay", "0.7", "--norm-weight-decay", "0"),
)


class Crash(Exception):
    """A process dying at the start of an epoch: what it leaves is the checkpoint of the epoch before."""


def train(flags, monkeypatch, crash_at_epoch=None) -> None:
    """train_single_gpu.py's main on `flags`, in this process, crashing at the start of `crash_at_epoch`."""
    module = importlib.import_module("train_single_gpu")
    real = module.train_one_epoch

    def crashing(training, data_loader, device, epoch, *args, **kwargs):
        if epoch == crash_at_epoch:
            raise Crash
        return real(training, data_loader, device, epoch, *args, **kwargs)

    with monkeypatch.context() as patches:
        patches.setattr(module, "train_one_epoch", crashing)
        try:
            module.main([str(flag) for flag in flags])
        except Crash:
            assert crash_at_epoch is not None


def test_a_timm_model_trains_and_a_resumed_run_ends_as_the_uninterrupted_one(
    tiny_data, tmp_path, monkeypatch, run_main
):
    flags = ("--data-path", tiny_data, *TIMM_RUN)
    train((*flags, "--output-dir", tmp_path / "whole"), monkeypatch)
    out = tmp_path / "resumed"
    train((*flags, "--output-dir", out), monkeypatch, crash_at_epoch=1)
    assert load_checkpoint(out / "checkpoint.pth")["epoch"] == 0
    # the recipe is the checkpoint's: another --norm-weight-decay is refused, in one line, before anything changes
    refused = run_main(
        "train_single_gpu.py", *flags[:-2], "--norm-weight-decay", "0.01", "--resume", out / "checkpoint.pth"
    )
    assert_user_error(refused, "--norm-weight-decay 0.0 (not 0.01)")
    train((*flags, "--resume", out / "checkpoint.pth"), monkeypatch)
    expected, weights = final_weights(tmp_path / "whole"), final_weights(out)
    assert "fc.weight" in weights and weights["fc.weight"].shape[0] == 5  # timm's ResNet, its head for our classes
    assert all(torch.equal(expected[key], weights[key]) for key in expected)
    assert metrics_without_timings(out) == metrics_without_timings(tmp_path / "whole")


# --sync-bn for timm's models -------------------------------------------------------------------------------------


class CountedTwoRanks(TwoRanks):
    """test_host_syncs.py's group of two ranks of the same batch, counting the all-reduces."""

    reduced = 0

    @classmethod
    def all_reduce(cls, tensor, *args, **kwargs):
        cls.reduced += 1
        TwoRanks.all_reduce(tensor)


def test_sync_bn_synchronises_timms_batchnorm_with_its_activation(monkeypatch):
    # timm's EfficientNet keeps BatchNorm and its activation in one layer (BatchNormAct2d), a subclass of
    # BatchNorm2d: each is replaced, and computes as before with its activation (two ranks of the same batch give
    # that batch's statistics), its statistics now the global batch's (one all-reduce a layer in the forward pass)
    from multi_train_utils import sync_batchnorm

    torch.manual_seed(0)
    network = create_model(5, "timm/test_efficientnet").double().train()
    synced = sync_batchnorm.convert_sync_batchnorm(copy.deepcopy(network))
    layers = [layer for layer in network.modules() if isinstance(layer, nn.BatchNorm2d)]
    kinds = {type(layer).__name__ for layer in synced.modules() if isinstance(layer, nn.BatchNorm2d)}
    assert len(layers) > 5 and kinds == {"SyncBatchNormAct2d"}, kinds
    assert synced.state_dict().keys() == network.state_dict().keys()
    monkeypatch.setattr(sync_batchnorm, "dist", CountedTwoRanks)
    images = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    assert torch.allclose(synced(images), network(images), atol=1e-10)
    assert CountedTwoRanks.reduced == len(layers)
