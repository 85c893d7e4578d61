"""An epoch's files (multi_train_utils/checkpoint.py, save_epoch): each tensor of the training state serialised once,
the weights' other names links to that file (or copies where the filesystem has no links), a checkpoint that names
the weights file it needs and loads whole after a kill between any two of the writes, and a checkpoint of an
earlier version (the weights inside it) still loaded. Tiny state dicts, pure file operations."""

import errno
import os

import pytest
import torch
from torch import nn

import multi_train_utils.checkpoint as checkpoint
from multi_train_utils.checkpoint import load_checkpoint, restore, save_atomically, save_epoch, tensor_bytes
from multi_train_utils.train_eval_utils import Training
from network.weights import read_state_dict
from recipe.optimizer import model_ema

pytestmark = pytest.mark.fast


def trained(seed: int, ema: bool) -> Training:
    """A tiny network after one SGD step with momentum (so that the optimizer holds a buffer a weight), and its EMA."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = Training(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    training.ema = model_ema(model, 0.5) if ema else None
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    training.scheduler.step()
    if training.ema is not None:
        training.ema.update_parameters(model)
    return training


def state_of(training: Training, epoch: int) -> dict:
    return checkpoint.training_state(epoch, training.model, training, 0.5, ["a", "b", "c"], 1, {})


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def serialised(monkeypatch) -> list[int]:
    """The tensor bytes of each torch.save from now on."""
    saved, real_save = [], torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: saved.append(tensor_bytes(obj)) or real_save(obj, f))
    return saved


CASES = [(False, None, False), (False, "model", True), (True, None, False), (True, "model", False), (True, "ema", True)]


@pytest.mark.parametrize("ema, best, keep", CASES)
def test_an_epoch_serialises_each_tensor_of_its_state_once(tmp_path, monkeypatch, ema, best, keep):
    state = state_of(trained(0, ema), 0)
    saved = serialised(monkeypatch)
    save_epoch(tmp_path, 0, state, best, keep=keep)
    assert sum(saved) == tensor_bytes(state)  # the weights once, whether best.pth and model-N.pth are written or not
    assert len(saved) == 2 + ema  # the weights, the EMA's, the checkpoint
    names = {"last.pth", ".model-0.pth", ".ema-0.pth", "best.pth", "model-0.pth"}
    names -= {".ema-0.pth"} if not ema else set()
    names -= {"best.pth"} if best is None else set()
    names -= {"model-0.pth"} if not keep else set()
    assert {path.name for path in (tmp_path / "weights").iterdir()} == names


def test_best_pth_last_pth_and_model_n_are_links_of_the_file_the_checkpoint_names(tmp_path):
    save_epoch(tmp_path, 3, state_of(trained(0, True), 3), "model", keep=True)
    weights = tmp_path / "weights"
    named = torch.load(tmp_path / "checkpoint.pth", weights_only=True)["model"]["weights_file"]
    assert named == "weights/.model-3.pth"
    for name in ("last.pth", "best.pth", "model-3.pth"):
        assert os.path.samefile(weights / name, weights / ".model-3.pth"), name


def test_an_ema_that_validated_best_is_linked_as_best_pth_under_the_networks_names(tmp_path):
    training = trained(0, True)
    save_epoch(tmp_path, 0, state_of(training, 0), "ema")
    assert os.path.samefile(tmp_path / "weights" / "best.pth", tmp_path / "weights" / ".ema-0.pth")
    assert same(torch.load(tmp_path / "weights" / "best.pth", weights_only=True), training.ema.module.state_dict())


def test_the_checkpoint_reads_back_the_weights_of_its_files_and_restores_them(tmp_path):
    saved, resumed = trained(0, True), trained(1, True)
    save_epoch(tmp_path, 0, state_of(saved, 0), "model")
    state = load_checkpoint(tmp_path / "checkpoint.pth")
    assert same(state["model"], saved.model.state_dict()) and same(state["ema"], saved.ema.state_dict())
    assert restore(state, resumed.model, resumed) == (1, 0.5)
    assert same(resumed.ema.state_dict(), saved.ema.state_dict())
    assert same(read_state_dict(tmp_path / "checkpoint.pth"), saved.model.state_dict())  # as predict.py reads it


def test_the_previous_epochs_file_is_removed_once_the_new_checkpoint_is_written_and_best_pth_keeps_its_data(tmp_path):
    first, second = trained(0, True), trained(1, True)
    save_epoch(tmp_path, 0, state_of(first, 0), "model")
    save_epoch(tmp_path, 1, state_of(second, 1), None)
    names = {path.name for path in (tmp_path / "weights").iterdir()}
    assert names == {"last.pth", "best.pth", ".model-1.pth", ".ema-1.pth"}
    assert same(torch.load(tmp_path / "weights" / "best.pth", weights_only=True), first.model.state_dict())


def test_a_checkpoint_of_an_earlier_version_with_its_weights_inside_still_loads(tmp_path):
    saved, resumed = trained(0, True), trained(1, True)
    save_atomically(state_of(saved, 2), tmp_path / "checkpoint.pth")  # as save_epoch wrote it before
    state = load_checkpoint(tmp_path / "checkpoint.pth")
    assert restore(state, resumed.model, resumed) == (3, 0.5)
    assert same(resumed.model.state_dict(), saved.model.state_dict())
    assert same(read_state_dict(tmp_path / "checkpoint.pth"), saved.model.state_dict())


class Killed(BaseException):
    """The process ended here, as by SIGKILL: nothing after it runs (no OSError handler catches it)."""


def killed_at(monkeypatch, write: int) -> None:
    """Every file operation an epoch's save makes from now on counted; the `write`-th (from 0) never happens."""
    count = iter(range(10**6))

    def counted(real):
        def operation(*args, **kwargs):
            if next(count) == write:
                raise Killed
            return real(*args, **kwargs)

        return operation

    for module, name in [(torch, "save"), (os, "link"), (os, "replace"), (os, "unlink")]:
        monkeypatch.setattr(module, name, counted(getattr(module, name)))


def test_a_kill_between_any_two_writes_leaves_a_checkpoint_whose_weights_exist_and_match_it(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda descriptor: None)  # what a kill leaves does not depend on it; it is slow
    before, after = trained(0, True), trained(1, True)
    for write in range(100):
        out = tmp_path / str(write)
        save_epoch(out, 0, state_of(before, 0), "model", keep=True)
        with pytest.MonkeyPatch.context() as monkeypatch:
            killed_at(monkeypatch, write)
            try:
                save_epoch(out, 1, state_of(after, 1), "ema", keep=True)
                break  # every write of the epoch done
            except Killed:
                pass
        state = load_checkpoint(out / "checkpoint.pth")
        expected = [before, after][state["epoch"]]
        assert same(state["model"], expected.model.state_dict()) and same(state["ema"], expected.ema.state_dict())
        save_epoch(out, 1, state_of(after, 1), "ema", keep=True)  # the resumed run writes the epoch again
        names = {path.name for path in (out / "weights").iterdir()}
        assert names == {"last.pth", "best.pth", "model-0.pth", "model-1.pth", ".model-1.pth", ".ema-1.pth"}
    else:
        raise AssertionError("the epoch's save never ended")
    assert write > 8  # a kill at each of the epoch's writes was tried before the try that had none


def test_without_hard_links_the_files_are_copies_with_the_same_contents(tmp_path, monkeypatch):
    state = state_of(trained(0, True), 0)
    save_epoch(tmp_path / "linked", 0, state, "ema", keep=True)

    def refused(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")  # as FAT or exFAT answer

    monkeypatch.setattr(os, "link", refused)
    save_epoch(tmp_path / "copied", 0, state, "ema", keep=True)
    linked, copied = tmp_path / "linked" / "weights", tmp_path / "copied" / "weights"
    assert {path.name for path in copied.iterdir()} == {path.name for path in linked.iterdir()}
    for path in linked.iterdir():
        assert (copied / path.name).read_bytes() == path.read_bytes(), path.name
    assert all(path.stat().st_nlink == 1 for path in copied.iterdir())  # copies, not links
    assert same(load_checkpoint(tmp_path / "copied" / "checkpoint.pth")["model"], state["model"])
