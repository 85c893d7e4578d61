"""The recipe options, each against what it says it does: the warmup and cosine schedule step by step, label
smoothing and class weights against their formulas, mixup/cutmix and the per-image augmentations independent of
the loader's workers, the weights' moving average against a hand-computed one, and any torchvision model's
head found, frozen around, synchronised and loaded past."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel
from torchvision.models import get_model
from wiring import loaders

from dataset.folders import read_split_data
from dataset.images import SKIPPED
from multi_train_utils.sync_batchnorm import SyncBatchNorm2d, convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Training, train_one_epoch
from network.architectures import create_model, freeze_all_but_head, head_names
from network.weights import load_weights
from recipe.loss import Objective, balanced_class_weights
from recipe.optimizer import build_optimizer, model_ema, schedule_factor
from run.config import Config

pytestmark = pytest.mark.fast  # no script started, no training run

OPTIMIZER = dict(momentum=0.9, weight_decay=0.0, lrf=0.1)


def rates(epochs, steps_per_epoch, warmup_epochs, lr=0.1, **options):
    """The learning rate at every optimizer step of a run, as the scheduler sets it."""
    model = nn.Linear(2, 2)
    config = Config(lr=lr, epochs=epochs, warmup_epochs=warmup_epochs, **{**OPTIMIZER, **options})
    optimizer, scheduler = build_optimizer(model, config, batches_per_epoch=steps_per_epoch)
    seen = []
    for _ in range(epochs * steps_per_epoch):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_warmup_rises_linearly_step_by_step_then_the_cosine_falls_to_lrf():
    lr = rates(epochs=5, steps_per_epoch=3, warmup_epochs=2)
    assert lr[:6] == pytest.approx([0.1 * (step + 1) / 6 for step in range(6)])  # 1/W .. W/W of the rate
    assert lr[6] == pytest.approx(0.1)  # the cosine starts at the full rate
    after = [0.1 * (0.1 + 0.9 * (1 + math.cos(math.pi * s / 9)) / 2) for s in range(9)]
    assert lr[6:] == pytest.approx(after)
    assert all(a > b for a, b in zip(lr[6:], lr[7:], strict=False))


def test_without_warmup_each_epoch_starts_where_the_per_epoch_cosine_was():
    lr = rates(epochs=4, steps_per_epoch=5, warmup_epochs=0)
    starts = lr[::5]
    assert starts == pytest.approx([0.1 * (0.1 + 0.9 * (1 + math.cos(math.pi * e / 4)) / 2) for e in range(4)])
    assert schedule_factor(20, steps_per_epoch=5, epochs=4, warmup_epochs=0, lrf=0.1) == pytest.approx(0.1)


def test_the_rate_scales_with_processes_and_accumulated_micro_batches_and_adamw_is_adamw():
    model = nn.Linear(2, 2)
    common = dict(momentum=0.9, weight_decay=0.05, epochs=1, lrf=0.1)
    optimizer, _ = build_optimizer(model, Config(lr=0.01, accumulate=2, **common), 1, world_size=4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.08) and isinstance(optimizer, torch.optim.SGD)
    optimizer, _ = build_optimizer(model, Config(lr=0.01, opt="adamw", **common), 1, world_size=1)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["weight_decay"] == 0.05


def logits_and_labels():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1, 0])


def test_the_plain_objective_is_cross_entropy_and_skipped_images_add_nothing():
    outputs, labels = logits_and_labels()
    assert Objective().loss_sum(outputs, labels) == pytest.approx(F.cross_entropy(outputs, labels, reduction="sum"))
    labels[2] = SKIPPED
    expected = F.cross_entropy(outputs, labels, reduction="sum", ignore_index=SKIPPED)
    assert Objective().loss_sum(outputs, labels) == pytest.approx(expected.item())


def test_label_smoothing_follows_its_formula():
    outputs, labels = logits_and_labels()
    eps, k = 0.1, outputs.shape[1]
    log_p = F.log_softmax(outputs, dim=1)
    # each image: (1 - eps) of its class's -log p, plus eps spread evenly over all k classes
    by_hand = sum((1 - eps) * -log_p[i, y] + eps / k * -log_p[i].sum() for i, y in enumerate(labels.tolist()))
    loss = Objective(label_smoothing=eps).loss_sum(outputs, labels)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-12)
    assert loss.item() == pytest.approx(F.cross_entropy(outputs, labels, label_smoothing=eps, reduction="sum").item())


def test_balanced_class_weights_are_inverse_frequencies_and_weigh_each_image_by_its_class():
    weights = balanced_class_weights([0, 0, 0, 1, 2, 2], num_classes=4)
    # 6 images over 4 classes: a class of n images weighs 6 / (4 n); a class without images, 0
    assert weights.tolist() == pytest.approx([6 / 12, 6 / 4, 6 / 8, 0.0])
    outputs, labels = logits_and_labels()
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0])
    log_p = F.log_softmax(outputs, dim=1)
    by_hand = sum(weights[y] * -log_p[i, y] for i, y in enumerate(labels.tolist()))
    loss = Objective(class_weights=weights).loss_sum(outputs, labels)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-12)
    assert loss.item() != pytest.approx(Objective().loss_sum(outputs, labels).item())


def test_mixup_and_cutmix_are_drawn_from_seed_epoch_and_step_and_mix_targets_as_they_mix_images():
    images = torch.rand(4, 3, 8, 8)
    labels = torch.tensor([0, 1, 2, SKIPPED])
    mixing_objective = Objective(mixup_alpha=0.4, cutmix_alpha=1.0, seed=7)
    mixed, mixing = mixing_objective.mix(images.clone(), epoch=2, step=5)
    again, same = Objective(mixup_alpha=0.4, cutmix_alpha=1.0, seed=7).mix(images.clone(), epoch=2, step=5)
    assert torch.equal(mixed, again) and torch.equal(mixing, same)  # a function of (seed, epoch, step) alone
    other = [mixing_objective.mix(images.clone(), epoch=2, step=s)[1] for s in range(6, 12)]
    assert any(not torch.equal(mixing, m) for m in other)
    # Each mixed image is its own share plus the previous image's (torchvision pairs image i with i - 1).
    lam = mixing.diagonal()
    assert torch.allclose(mixing, torch.diag(lam) + torch.diag(1 - lam).roll(1, dims=0))
    targets = mixing_objective.targets(labels, 3, mixing)
    assert torch.allclose(
        targets[1], lam[1] * F.one_hot(torch.tensor(1), 3) + (1 - lam[1]) * F.one_hot(torch.tensor(0), 3)
    )
    assert torch.allclose(targets[3].sum(), 1 - lam[3])  # the skipped image's own share adds nothing
    torch.manual_seed(0)
    state = torch.get_rng_state()
    mixing_objective.mix(images, epoch=0, step=0)
    assert torch.equal(torch.get_rng_state(), state)  # the training's random stream is left alone


def test_mixup_mixes_pixels_by_the_share_in_its_matrix():
    images = torch.rand(4, 3, 8, 8)
    mixed, mixing = Objective(mixup_alpha=0.4).mix(images.clone(), epoch=0, step=0)
    lam = mixing[0, 0]
    assert torch.allclose(mixed, lam * images + (1 - lam) * images.roll(1, dims=0), atol=1e-6)


@pytest.mark.guarantee
def test_augmented_and_mixed_batches_are_identical_for_0_1_and_2_loader_workers(tiny_data):
    split = read_split_data(tiny_data, 0.2, 0)
    objective = Objective(mixup_alpha=0.2, cutmix_alpha=1.0, seed=3)

    def batches(workers):
        loader = loaders(
            split, img_size=32, batch_size=4, seed=3, workers=workers, auto_augment="trivialaugment",
            random_erase=0.5,
        )[0]  # fmt: skip
        loader.batch_sampler.set_epoch(1)
        return [objective.mix(images, 1, step) for step, (images, _) in zip(range(3), loader, strict=False)]

    expected = batches(0)
    for workers in (1, 2):
        for (images, mixing), (want_images, want_mixing) in zip(batches(workers), expected, strict=True):
            assert torch.equal(images, want_images) and torch.equal(mixing, want_mixing)
    assert not torch.equal(expected[0][0], build_plain_batch(split))  # the options did change the images


def build_plain_batch(split):
    loader = loaders(split, img_size=32, batch_size=4, seed=3)[0]
    loader.batch_sampler.set_epoch(1)
    return next(iter(loader))[0]


def small_network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))


def test_the_moving_average_is_the_hand_computed_one_buffers_included():
    model, decay = small_network(), 0.8
    batches = [(torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    model(batches[0][0])  # materialise the lazy layer
    ema = model_ema(model, decay)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for batch in batches:
        train_one_epoch(Training(model, optimizer, ema=ema), [batch], "cpu", 0)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in ("0.weight", "4.bias", "1.running_mean", "1.running_var"):
        expected = states[0][key]  # the first step copies the weights
        for state in states[1:]:
            expected = decay * expected + (1 - decay) * state[key]
        assert torch.allclose(ema.module.state_dict()[key], expected, atol=1e-6), key
        assert not torch.allclose(expected, states[-1][key])  # the average is not simply the last weights
    assert ema.module.state_dict()["1.num_batches_tracked"] == states[-1]["1.num_batches_tracked"]  # counts copied
    assert ema.state_dict().keys() == AveragedModel(model, use_buffers=True).state_dict().keys()  # torch's checkpoints


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0"])
def test_any_model_has_its_head_found_frozen_around_synchronised_and_loaded_past(name):
    head = head_names(name)
    model = create_model(5, name)
    assert head and all(model.state_dict()[key].shape[0] == 5 for key in head)
    freeze_all_but_head(model, name)
    trainable = {key for key, p in model.named_parameters() if p.requires_grad}
    assert trainable == head
    synced = convert_sync_batchnorm(create_model(5, name))
    assert not any(type(m) is nn.BatchNorm2d for m in synced.modules())
    assert any(isinstance(m, SyncBatchNorm2d) for m in synced.modules())
    imagenet_like = get_model(name, num_classes=1000).state_dict()  # the official file's layout
    report = load_weights(create_model(5, name), imagenet_like, name=name)
    assert set(report.skipped_shape) == head and len(report.loaded) == len(imagenet_like) - len(head)
