"""The GPU path's promises that a CPU can check, with torch's CUDA functions substituted (tests/fake_cuda.py): a
checkpoint of any number of GPUs resumes on any other; a step on cuda:N waits for its sums on cuda:N's stream; a
checkpoint of a bfloat16 or float32 run resumes with float16's gradient scaler; cuDNN's autotuning is on; and the
random numbers a step draws (dropout) are its own, so a resumed run draws what the uninterrupted one drew and no
two ranks draw alike; and an epoch resumed after a stop at a step reports the time and speed of its whole training."""

import copy
import signal
from types import SimpleNamespace

import pytest
import torch
from fake_cuda import FakeCuda
from torch import nn
from torch.utils.data import DataLoader

import multi_train_utils.bookkeeping as bookkeeping
import multi_train_utils.train_eval_utils as train_eval_utils
from multi_train_utils import stop_and_resume
from multi_train_utils.checkpoint import load_checkpoint, restore, save_atomically, training_state
from multi_train_utils.distributed_utils import shuffled_batches, single_process
from multi_train_utils.stop_and_resume import Midway, StopRequested, resume_from, stop_signals_noted
from multi_train_utils.train_eval_utils import Choice, Training, train_one_epoch
from recipe.optimizer import build_optimizer
from run.config import Config
from run.metrics import epoch_metrics

pytestmark = pytest.mark.fast


class Images:
    """16 small random images of 2 classes, as a dataset of (image, label), asked for as (index, seed) as the
    scripts' training sets are (nothing of it is drawn at random: the seed goes unused)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(16, 3, 4, 4, generator=generator)
        self.labels = torch.randint(0, 2, (16,), generator=generator)

    def __len__(self):
        return 16

    def __getitem__(self, item):
        index, _ = item
        return self.images[index], self.labels[index]


def dropout_network() -> nn.Module:
    """A network that draws random numbers in its forward pass (dropout), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))


def fresh_training() -> Training:
    model = dropout_network()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    return Training(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def loader(images: Images | None = None):
    """Seeded batches of 4 of `images` (Images()), as the scripts' training loaders give them (a SeededBatchSampler)."""
    dataset = Images() if images is None else images
    return DataLoader(dataset, batch_sampler=shuffled_batches(dataset, 4, seed=0))


def train(training: Training, data, epochs: range) -> None:
    for epoch in epochs:
        data.batch_sampler.set_epoch(epoch)
        train_one_epoch(training, data, "cpu", epoch)


def weights(training: Training) -> dict:
    return copy.deepcopy(training.model.state_dict())


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), "the weights differ"


def test_a_network_with_dropout_resumed_after_an_epoch_takes_the_steps_of_the_uninterrupted_run(tmp_path):
    uninterrupted = fresh_training()
    train(uninterrupted, loader(), range(2))

    first = fresh_training()
    train(first, loader(), range(1))
    save_atomically(training_state(0, first.model, first, 0.0, ["a", "b"], 1, {}), tmp_path / "checkpoint.pth")
    torch.manual_seed(12345)  # a new process: its generators as they come
    resumed = fresh_training()
    assert resume_from(tmp_path / "checkpoint.pth", resumed.model, resumed, 2) == (1, 0.0)
    train(resumed, loader(), range(1, 2))
    assert_same(weights(resumed), weights(uninterrupted))


def test_a_network_with_dropout_stopped_within_an_epoch_resumes_to_the_uninterrupted_runs_weights():
    uninterrupted = fresh_training()
    train(uninterrupted, loader(), range(1))

    stopped, data = fresh_training(), loader()
    with stop_signals_noted(), pytest.raises(StopRequested) as stop:
        stop_and_resume.noted.append(signal.SIGTERM)  # as if SLURM had sent it: the run stops at a step
        train(stopped, data, range(1))
    assert 0 < stop.value.step < len(data)
    model_state, optimizer_state = weights(stopped), copy.deepcopy(stopped.optimizer.state_dict())
    torch.manual_seed(12345)  # a new process: its generators as they come
    resumed = fresh_training()
    resumed.model.load_state_dict(model_state)
    resumed.optimizer.load_state_dict(optimizer_state)
    resumed.midway = Midway(stop.value.step, stop.value.totals, stop.value.lr)
    train(resumed, loader(), range(1))
    assert_same(weights(resumed), weights(uninterrupted))


class Clock:
    """time.perf_counter for the code that times an epoch, moved on by hand."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SlowImages(Images):
    """Images, each taking a quarter of a second of `clock` to load: a second a batch of 4."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock

    def __getitem__(self, item):
        self.clock.now += 0.25
        return super().__getitem__(item)


def test_a_resumed_epochs_time_and_speed_count_its_training_before_the_stop_and_not_the_time_stopped(monkeypatch):
    clock = Clock()
    for module in (bookkeeping, train_eval_utils):
        monkeypatch.setattr(module, "time", clock)
    stopped, data = fresh_training(), loader(SlowImages(clock))
    with stop_signals_noted(), pytest.raises(StopRequested) as stop:
        stop_and_resume.noted.append(signal.SIGTERM)
        train(stopped, data, range(1))
    assert stop.value.seconds == stop.value.step == 2  # the two steps trained, a second each
    clock.now += 3600  # stopped for an hour
    resumed = fresh_training()
    resumed.midway = Midway.of({"midway": stop.value.midway()})  # as the checkpoint holds it
    start = resumed.epoch_start()  # as the scripts time an epoch
    trained = train_one_epoch(resumed, loader(SlowImages(clock)), "cpu", 0)
    seconds = (clock.now - start, clock.now + 1 - start)  # (training, with a second of validation)
    process = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    metrics = epoch_metrics(0, 0.1, trained, seconds, torch.eye(2, dtype=torch.int64), (16, 2), process)
    assert metrics["train_images"] == 16 and metrics["epoch_seconds"] == 5.0  # the epoch's 4 steps, validated
    assert metrics["train_images_per_sec"] == 4.0  # its 16 images in its 4 seconds of training


def test_a_checkpoint_stopped_at_a_step_by_an_earlier_version_resumes_counting_no_seconds_before_the_stop():
    midway = Midway.of({"midway": {"step": 2, "totals": [1.0, 8.0, 0.0], "lr": 0.1}})
    assert midway == Midway(2, [1.0, 8.0, 0.0], 0.1, seconds=0.0)


def dropout_masks(rank: int, monkeypatch) -> list[torch.Tensor]:
    """The dropout masks of an epoch's steps on process `rank`."""
    monkeypatch.setattr(bookkeeping, "get_rank", lambda: rank)
    masks, dropout = [], nn.Dropout(0.5)
    for _ in bookkeeping.EpochBooks(fresh_training(), [None] * 3, torch.device("cpu"), epoch=0).steps():
        masks.append(dropout(torch.ones(64)))
    return masks


def test_each_rank_draws_dropout_masks_of_its_own_and_the_same_at_the_same_step_whatever_came_before(monkeypatch):
    rank_0, rank_1 = dropout_masks(0, monkeypatch), dropout_masks(1, monkeypatch)
    assert all(not torch.equal(a, b) for a, b in zip(rank_0, rank_1, strict=True))
    torch.manual_seed(999)
    assert all(torch.equal(a, b) for a, b in zip(rank_0, dropout_masks(0, monkeypatch), strict=True))


@pytest.mark.parametrize("saved_on, resumed_on", [(8, 4), (2, 1), (1, 2), (8, 1)])
def test_a_checkpoint_saved_with_any_number_of_gpus_resumes_with_any_other(saved_on, resumed_on, tmp_path):
    training = fresh_training()
    state = training_state(0, training.model, training, 0.5, ["a", "b"], saved_on, {})
    with FakeCuda(devices=saved_on):  # what earlier versions saved too: every GPU's generator, as rank 0 saw them
        state["rng"] = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    save_atomically(state, tmp_path / "checkpoint.pth")
    state, resumed = load_checkpoint(tmp_path / "checkpoint.pth"), fresh_training()  # (torch.load is real here)
    with FakeCuda(devices=resumed_on):
        assert restore(state, resumed.model, resumed) == (1, 0.5)
    assert_same(weights(resumed), weights(training))


def test_one_process_on_cuda_1_makes_it_the_current_gpu_and_waits_for_its_sums_on_its_stream():
    with FakeCuda(devices=2) as cuda:
        process = single_process("cuda:1")
        assert process.device == torch.device("cuda", 1) and cuda.current == 1
        with torch.device(process.device):
            training = fresh_training()
        batches = [(torch.randn(4, 3, 4, 4), torch.tensor([0, 1, 0, 1])) for _ in range(3)]
        train_one_epoch(training, batches, process.device, 0)
    assert cuda.events == [torch.device("cuda", 1)] * 3  # each step's sums, recorded on cuda:1's stream


def test_training_on_a_gpu_lets_cudnn_time_its_convolution_algorithms(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    with FakeCuda():
        single_process("cuda")
    assert torch.backends.cudnn.benchmark
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    single_process("cpu")
    assert not torch.backends.cudnn.benchmark


@pytest.mark.parametrize("saved_amp", ["bf16", "off"], ids=["bf16", "float32"])
def test_a_checkpoint_trained_without_float16_resumes_with_float16s_gradient_scaler(saved_amp, tmp_path):
    cpu = torch.device("cpu")
    saved = fresh_training()
    saved.scaler = Choice(saved_amp).grad_scaler(cpu)  # off: its state is empty
    save_atomically(training_state(0, saved.model, saved, 0.5, ["a", "b"], 1, {}), tmp_path / "checkpoint.pth")
    resumed = fresh_training()
    resumed.choice, resumed.scaler = Choice("fp16"), Choice("fp16").grad_scaler(cpu)
    assert restore(load_checkpoint(tmp_path / "checkpoint.pth"), resumed.model, resumed) == (1, 0.5)
    assert resumed.scaler.is_enabled() and resumed.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    batches = [(torch.randn(4, 3, 4, 4), torch.tensor([0, 1, 0, 1])) for _ in range(2)]
    train_one_epoch(resumed, batches, cpu, 1)  # and trains on


def sgd_steps(fused: bool) -> tuple[dict, dict]:
    """(the weights, the momentum) after four float16 steps of build_optimizer's SGD (or, not `fused`, torch's
    default SGD), the first and the third overflowing (skipped by the gradient scaler)."""
    model = dropout_network()
    config = Config(lr=0.1, weight_decay=1e-4, epochs=1)
    optimizer = build_optimizer(model, config, 4)[0] if fused else torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=config.momentum, weight_decay=1e-4
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 3, 4, 4)).sum()).backward()
        if step in (0, 2):
            model[1].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
    momentum = {name: optimizer.state[p]["momentum_buffer"] for name, p in model.named_parameters()}
    return weights(SimpleNamespace(model=model)), momentum


def test_float16_steps_skipped_by_the_scaler_leave_the_fused_sgd_as_torchs_default_sgd_leaves_it():
    """torch's fused SGD alone would read momentum buffers it never set after a skipped first step (see
    build_optimizer)."""
    fused, default = sgd_steps(fused=True), sgd_steps(fused=False)
    torch.testing.assert_close(fused, default)  # (to rounding: the fused kernel multiplies and adds in one)
