"""Loading weights: ImageNet-style files, our own saved weights, wrapper prefixes, and files that must be refused."""

import pickle

import pytest
import torch
from torchvision.models import resnet18, resnet34, resnet50

from model import create_model, freeze_all_but_head, load_weights
from utils import UserError


def test_a_1000_class_file_loads_everything_but_the_head(tmp_path):
    torch.manual_seed(0)
    imagenet_like = resnet34()  # the official file's layout: 1000-class fc
    torch.save(imagenet_like.state_dict(), tmp_path / "resnet34-imagenet.pth")
    model = create_model(num_classes=5)
    head_before = model.fc.weight.clone()

    report = load_weights(model, tmp_path / "resnet34-imagenet.pth")

    assert sorted(report.skipped_shape) == ["fc.bias", "fc.weight"]
    assert report.missing == [] and report.unexpected == []
    assert torch.equal(model.layer4[2].conv2.weight, imagenet_like.layer4[2].conv2.weight)
    assert torch.equal(model.bn1.running_var, imagenet_like.bn1.running_var)
    assert torch.equal(model.fc.weight, head_before)
    assert "2 skipped for a different shape" in report.summary()


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    torch.manual_seed(1)
    source = create_model(5)
    torch.save({prefix + k: v for k, v in source.state_dict().items()}, tmp_path / "w.pth")
    model = create_model(5)
    report = load_weights(model, tmp_path / "w.pth")
    assert not report.missing and not report.unexpected and not report.skipped_shape
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=True)
    )


def test_saved_weights_are_a_plain_torchvision_state_dict(tmp_path):
    model = create_model(5)
    torch.save(model.state_dict(), tmp_path / "model-0.pth")
    plain = resnet34(num_classes=5)
    plain.load_state_dict(torch.load(tmp_path / "model-0.pth", weights_only=True))  # strict: every key matches


def test_a_checkpoint_holding_the_model_under_model_is_accepted(tmp_path):
    model = create_model(5)
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "checkpoint.pth")
    assert len(load_weights(create_model(5), tmp_path / "checkpoint.pth").loaded) == len(model.state_dict())


def test_missing_counters_and_unexpected_keys_are_reported(tmp_path):
    state = create_model(5).state_dict()
    del state["bn1.num_batches_tracked"]  # as in files saved before torchvision 0.4.1
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "w.pth")
    report = load_weights(create_model(5), tmp_path / "w.pth")
    assert report.missing == ["bn1.num_batches_tracked"]
    assert report.unexpected == ["extra.weight"]
    assert "1 missing from the file" in report.summary() and "1 in the file but not in the model" in report.summary()


def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save({"encoder.weight": torch.zeros(3, 3)}, tmp_path / "other.pth")
    with pytest.raises(UserError, match="no tensor that fits"):
        load_weights(create_model(5), tmp_path / "other.pth")


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(UserError, match="does not hold a state dict"):
        load_weights(create_model(5), tmp_path / "list.pth")
    (tmp_path / "text.pth").write_text("hello")
    with pytest.raises(UserError, match="cannot be read|refused"):
        load_weights(create_model(5), tmp_path / "text.pth")
    with pytest.raises(UserError, match="does not exist"):
        load_weights(create_model(5), tmp_path / "absent.pth")


class RunsCode:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['PWNED_PATH'], 'w').write('ran')",))


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED_PATH", str(marker))
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"fc.weight": RunsCode()}, f, protocol=2)
    with pytest.raises(UserError, match="weights_only=True"):
        load_weights(create_model(5), tmp_path / "evil.pth")
    assert not marker.exists()


def test_freezing_leaves_only_the_head_trainable():
    model = create_model(5)
    freeze_all_but_head(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("other", [resnet18, resnet50])
def test_weights_of_another_resnet_are_refused(tmp_path, other):
    torch.save(other(num_classes=5).state_dict(), tmp_path / "other.pth")
    model = create_model(5)
    before = model.conv1.weight.clone()
    with pytest.raises(UserError, match="does not fit ResNet-34"):
        load_weights(model, tmp_path / "other.pth")
    assert torch.equal(model.conv1.weight, before)  # nothing half-loaded
