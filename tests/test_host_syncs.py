"""The GPU path never makes the host wait for the device in a training step or a validation batch, on every
precision and recipe switch: proven on fake CUDA tensors (tests/fake_cuda.py) on any machine, and on a real GPU
under torch.cuda.set_sync_debug_mode("error") where there is one.

The step is the scripts' own: train_one_epoch and evaluate, the model, optimizer, scaler, loss and EMA built by
train_single_gpu.py's statements (tests/wiring.py), SyncBatchNorm by the DDP scripts' converter. On fake CUDA an
`.item()`, a boolean mask, a bincount or a CPU tensor mixed into a CUDA operation fails, and every copy between the
host and the GPU that blocks is counted: an epoch of two optimizer steps must make no more of them than an epoch of
one (what an epoch does once, like reading the validation counts at its end, is allowed; what a step does is not).
"""

import collections
import itertools
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from fake_cuda import FakeCuda
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from wiring import model_as_trained, resnet10, training_as_built

import model as model_module
import multi_train_utils.sync_batchnorm as sync_batchnorm
from dataset.images import SKIPPED
from dataset.store import DecodedImages
from dataset.transforms import normalise_pixels, train_transform, val_transform
from multi_train_utils.distributed_utils import shuffled_batches
from multi_train_utils.sync_batchnorm import convert_sync_batchnorm
from multi_train_utils.train_eval_utils import Choice, evaluate, train_one_epoch
from my_dataset import MyDataSet, TrainingBatches, ValidationBatches
from run.config import Config

pytestmark = [
    # the EMA deep-copies the model, and torch's Tensor.__deepcopy__ looks at a fake tensor's (absent) data pointer
    pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor"),
]

FAST = pytest.mark.fast  # no script started, nothing trained but a step on fake tensors
CLASSES = 3
EVERY_SWITCH = {
    "model_ema": True, "class_weights": "balanced", "accumulate": 2, "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
    "label_smoothing": 0.1, "sync_bn": True, "channels_last": True, "micro_batch": 3,
    "clip_grad_norm": 1.0, "layer_decay": 0.8, "norm_weight_decay": 0.0,
}  # fmt: skip


class TwoRanks:
    """torch.distributed as SyncBatchNorm2d sees it in a group of two whose other rank has the same batch: its
    all-reduce doubles the sums. So its multi-process path runs in one process, on fake CUDA tensors too."""

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def get_world_size():
        return 2

    @staticmethod
    def all_reduce(tensor, *args, **kwargs):
        tensor.mul_(2)


class Batches(list):
    """A loader's batches, and its `dataset` (what evaluate counts the unreadable images against)."""

    def __init__(self, batches: list, images: int):
        super().__init__(batches)
        self.dataset = range(images)


def batches(count: int, size: int = 4, pixels: int = 32) -> Batches:
    """`count` batches of 8-bit images and labels, as the loaders give them (on the host); the first image of the
    first batch is one that could not be read (SKIPPED)."""
    generator = torch.Generator().manual_seed(0)
    made = Batches([], count * size)
    for _ in range(count):
        images = torch.randint(0, 256, (size, 3, pixels, pixels), dtype=torch.uint8, generator=generator)
        made.append((images, torch.randint(0, CLASSES, (size,), generator=generator)))
    made[0][1][0] = SKIPPED
    return made


def built(device: torch.device, amp: str, switches: dict):
    """(the training, the unwrapped model, its Choice) as train_single_gpu.py builds them, for a ResNet of one
    block a stage (tests/wiring.py's resnet10: every kind of layer of --model resnet18, each op on fake tensors a
    fraction of a millisecond); with sync_bn, its BatchNorm synchronised as in DDP."""
    switches = dict(switches)
    sync_bn, channels_last = switches.pop("sync_bn", False), switches.pop("channels_last", False)
    config = Config(model="resnet18", img_size=32, batch_size=4, epochs=4, weight_decay=1e-4, **switches)
    compute = Choice(amp, channels_last, config.micro_batch)  # 3 of 4: micro-batches of 3 and 1
    with mock.patch.object(model_module, "create_model", resnet10):
        trained, model = model_as_trained(CLASSES, compute, model=config.model, device=device)
    if sync_bn:
        trained = model = convert_sync_batchnorm(model)
    plan = SimpleNamespace(split=SimpleNamespace(classes=list("abc"), train_labels=[0, 0, 1, 2]))
    return training_as_built(config, plan, trained, model, batches(2), device, compute), model, compute


def epochs_of(kind: str, training, model, compute: Choice, device: torch.device, **limits):
    """run(data): an epoch on the batches `data`, of training ("train": the next epoch each call) or of
    validation ("validate", with `limits`: evaluate's max_skipped)."""
    if kind == "validate":
        return lambda data: evaluate(model, data, device, CLASSES, compute, topk=2, **limits)
    epochs = itertools.count()
    return lambda data: train_one_epoch(training, data, device, next(epochs))


def made_on_device(kind: str, device: torch.device, compute: Choice, streamed: bool = False):
    """data(count): `count` batches of 4 made on `device` as the scripts make them there (dataset/on_device.py):
    training batches cropped and flipped from images held on the device (or `streamed` to it), or validation
    images held there, from images decoded in memory as in a store (held_data)."""

    def data(count: int):
        train_set, val_set = held_data(count * 4)
        if kind == "train":
            batches = shuffled_batches(train_set, 4, 0)
            return TrainingBatches(train_set, batches, device, compute.memory_format, streamed)
        return ValidationBatches(val_set, range(len(val_set)), 4, device)

    return data


def held_data(count: int, pixels: int = 32) -> tuple[MyDataSet, MyDataSet]:
    """(training set, validation set) of `count` images of various sizes around 40 x 48, decoded in memory (no
    files) one after another, bytes past the last as in a store, with the scripts' transforms at `pixels`."""
    generator = torch.Generator().manual_seed(0)
    shapes = torch.tensor([[36 + index % 7, 48 - index % 5] for index in range(count)])
    sizes = 3 * shapes.prod(dim=1)
    offsets = sizes.cumsum(dim=0) - sizes
    flat = torch.randint(0, 256, (int(sizes.sum()) + 3 * 3 * 48,), dtype=torch.uint8, generator=generator)
    names, labels = [f"image{index}.jpg" for index in range(count)], [index % CLASSES for index in range(count)]
    sets = MyDataSet(names, labels, train_transform(pixels)), MyDataSet(names, labels, val_transform(pixels))
    for data in sets:
        data.decoded = DecodedImages(flat, offsets, shapes)
    return sets[0], sets[1]


def waits_per_epoch(
    run, waits: collections.Counter, data=None, step: int = 1
) -> tuple[collections.Counter, collections.Counter]:
    """What `waits` gained during an epoch of one optimizer step, run(data(step)), and during one of two,
    run(data(2 * step)) (`step`: the batches a step takes, --accumulate; data: `batches`, the loaders' host batches,
    by default), after an epoch of one step to warm up (the first step makes the optimizer's state, the EMA's first
    copy, ...). The data is made before anything is counted."""
    warm, short, long = ((data or batches)(count) for count in (step, step, 2 * step))
    counted = []
    run(warm)
    for made in (short, long):
        before = collections.Counter(waits)
        run(made)
        counted.append(waits - before)
    return tuple(counted)


def fake_cuda_waits(kind: str, amp: str, switches: dict, feed=None) -> tuple[collections.Counter, ...]:
    """waits_per_epoch of `kind` (epochs_of) on fake CUDA, as FakeCuda counts them, the batches made by a loader
    (on the host; `feed` None) or on the device ("held", "streamed"). (Without evaluate's limit on unreadable
    images: a fake confusion matrix reaches the host as zeros.)"""
    with FakeCuda() as cuda:
        device = torch.device("cuda")
        training, model, compute = built(device, amp, switches)
        data = None if feed is None else made_on_device(kind, device, compute, feed == "streamed")
        step = switches.get("accumulate", 1) if kind == "train" else 1
        return waits_per_epoch(epochs_of(kind, training, model, compute, device), cuda.waits, data, step)


PRECISIONS = ["off", "bf16", "fp16"]


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(sync_batchnorm, "dist", TwoRanks)


# The batches made by a loader, or on the device (--batches) from images held there or streamed to it
FEEDS = {"loader": None, "on-device": "held", "streamed": "streamed"}
# Each precision plain and with every switch, fed by a loader; fed on the device, in channels_last (the one switch
# that changes how a batch is made there: its layout; the others act on the step after it, as with a loader's)
CHANNELS_LAST = {"channels_last": True}
CASES = [
    *((amp, switches, "loader") for amp in PRECISIONS for switches in ({}, EVERY_SWITCH)),
    *((amp, CHANNELS_LAST, feed) for amp in PRECISIONS for feed in ("on-device", "streamed")),
]
NAMES = {0: "plain", len(CHANNELS_LAST): "channels-last", len(EVERY_SWITCH): "every-switch"}
# In the fast tier (pytest -m fast) all but the cases with every switch, which take about 10 s each on 2 cores
CASES = [
    pytest.param(*case, id=f"{case[0]}-{NAMES[len(case[1])]}-{case[2]}", marks=() if case[1] is EVERY_SWITCH else FAST)
    for case in CASES
]


@pytest.mark.parametrize("amp, switches, feed", CASES)
def test_a_training_step_on_fake_cuda_makes_the_host_wait_for_nothing(amp, switches, feed, two_ranks):
    short, long = fake_cuda_waits("train", amp, switches, FEEDS[feed])
    assert long == short, f"the host waits for the device in each step: {long - short} more in one more step"
    assert sum(long.values()) == 0, long  # nor once an epoch: the epoch's sums arrive without a blocking copy


@FAST
def test_each_streamed_batch_is_copied_on_a_stream_of_its_own_that_the_step_waits_for_on_the_device():
    """A streamed batch's copy is queued on the copy stream, an event recorded after it, and the step's stream waits
    for that event (the device waits, not the host) before the batch is cropped: one record and one wait a batch."""
    with FakeCuda() as cuda:
        device, compute = torch.device("cuda"), Choice(channels_last=True)
        normalise_pixels(torch.zeros(1, 3, 1, 1, device=device))  # the normalising constants, once a device
        before, data = collections.Counter(cuda.waits), made_on_device("train", device, compute, streamed=True)(3)
        for images, _ in data:
            assert images.device.type == "cuda" and images.is_contiguous(memory_format=torch.channels_last)
        assert cuda.waits == before, cuda.waits - before
        records = [event for what, _, event in cuda.stream_events if what == "record"]
        waits = [event for what, _, event in cuda.stream_events if what == "wait"]
        assert len(records) == 3 and waits == records  # each batch's own copy, waited for in order
        assert all(device_of.type == "cuda" for _, device_of, _ in cuda.stream_events)


@pytest.mark.parametrize("amp, switches, feed", [case for case in CASES if case.values[2] != "streamed"])
def test_a_validation_batch_on_fake_cuda_makes_the_host_wait_for_nothing(amp, switches, feed, two_ranks):
    short, long = fake_cuda_waits("validate", amp, switches, FEEDS[feed])
    assert long == short, f"the host waits for the device in each batch: {long - short} more in one more batch"
    assert long == {"blocking copy to the host": 1}  # the epoch's confusion matrix, once, at its end


class NcclGroup:
    """A process group of two, as torch's nn.SyncBatchNorm asks it for its backend."""

    @staticmethod
    def _get_backend_name():
        return "nccl"


@pytest.mark.fast
def test_torchs_own_sync_batchnorm_would_make_the_host_wait_in_every_layer(monkeypatch):
    """Why convert_sync_batchnorm puts SyncBatchNorm2d on a GPU too (multi_train_utils/sync_batchnorm.py)."""
    gather = lambda output, input, *args, **kwargs: output.copy_(torch.cat([input, input]).view_as(output))  # noqa: E731
    for name, value in {
        "is_initialized": lambda: True, "get_world_size": lambda group=None: 2,
        "all_gather_single": gather, "all_gather_into_tensor": gather,  # (torch 2.14's name; 2.11's)
    }.items():  # fmt: skip
        monkeypatch.setattr(torch.distributed, name, value, raising=False)
    with FakeCuda():
        with torch.device("cuda"):
            theirs, ours = nn.SyncBatchNorm(8), convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8)))
        theirs.process_group = NcclGroup()
        images = torch.randn(4, 8, 5, 5, device="cuda")
        with monkeypatch.context() as patches:
            patches.setattr(sync_batchnorm, "dist", TwoRanks)
            ours(images).sum().backward()  # the same statistics (test_distributed.py), nothing read on the host
        with pytest.raises(DynamicOutputShapeException):  # count_all[mask]: a size only the GPU knows
            theirs(images)


class SyncWarnings:
    """run(data) on a real GPU, counting in `waits` the syncs torch.cuda.set_sync_debug_mode("warn") reports; the
    batches pinned, as the scripts' loaders pin them there."""

    def __init__(self, run):
        self.run, self.waits = run, collections.Counter()

    def __call__(self, data):
        if isinstance(data, Batches):  # a loader's batches: pinned, as the loaders pin them on a GPU
            data = Batches([(images.pin_memory(), labels.pin_memory()) for images, labels in data], len(data) * 4)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run(data)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.waits["synchronizing CUDA operations"] += sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("amp", PRECISIONS)
def test_a_cuda_training_step_makes_no_host_sync_under_sync_debug_mode(amp, feed, two_ranks):
    device = torch.device("cuda")
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    training, model, compute = built(device, amp, EVERY_SWITCH)
    for kind, limits in (("train", {}), ("validate", {"max_skipped": 1})):
        run = SyncWarnings(epochs_of(kind, training, model, compute, device, **limits))
        data = None if FEEDS[feed] is None else made_on_device(kind, device, compute, FEEDS[feed] == "streamed")
        short, long = waits_per_epoch(run, run.waits, data, EVERY_SWITCH["accumulate"] if kind == "train" else 1)
        assert long == short, f"{kind}: the host waits for the GPU in each step: {long - short} more in one more step"
