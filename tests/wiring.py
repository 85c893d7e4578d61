"""The training scripts' wiring, for the tests that check its properties piece by piece: the loaders, the model
and the Training of a script's `train`, built by running that script's own statements (not a copy of them: a change
to a script is a change to what these tests check). And the small networks the step-by-step tests put in
create_model's place (resnet10), and a build kept to be copied (built_once)."""

import ast
import copy
import importlib
import inspect
import textwrap
from types import SimpleNamespace

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from dataset.store import StoredImages, store_folder
from dataset.transforms import decode_sides
from multi_train_utils.distributed_utils import Process
from multi_train_utils.train_eval_utils import Choice, Training
from run.config import Config

CPU = torch.device("cpu")
SINGLE, LAUNCH = "train_single_gpu", "train_multi_gpu_using_launch"


def train_statements(script: str) -> list[ast.stmt]:
    """The statements of the script's `train`, those inside its with and for blocks in their place, in order."""
    function = ast.parse(textwrap.dedent(inspect.getsource(importlib.import_module(script).train))).body[0]
    found, todo = [], list(function.body)
    while todo:
        statement = todo.pop(0)
        found.append(statement)
        if isinstance(statement, ast.With | ast.For):
            todo[:0] = statement.body
    return found


def assigned(statement: ast.stmt) -> set[str]:
    targets = getattr(statement, "targets", None) or [getattr(statement, "target", None)]
    return {
        node.id for target in targets if target is not None for node in ast.walk(target) if isinstance(node, ast.Name)
    }


def run_statements(script: str, first: str, last: str, **names) -> dict:
    """Run the statements of the script's `train` from the first that assigns `first` to the last that assigns
    `last`, with the script's own imports and `names` as the variables they read; returns the variables after."""
    statements = train_statements(script)
    start = next(i for i, statement in enumerate(statements) if first in assigned(statement))
    end = max(i for i, statement in enumerate(statements) if last in assigned(statement))
    module = importlib.import_module(script)
    namespace = {**vars(module), **names}
    exec(compile(ast.Module(body=statements[start : end + 1], type_ignores=[]), module.__file__, "exec"), namespace)
    return namespace


def loaders(split, img_size: int, batch_size: int, seed: int, world_size=1, rank=0, choice=Choice(), stored=True,
            **augment):  # fmt: skip
    """(training loader, validation loader) of process `rank` of `world_size` as the torchrun script builds them,
    with `choice` (its workers, and where batches are made: on the device, the CPU here), the images in the image
    store (`stored`: as a run makes it, in the session's store folder) or read from their files, the augmentation
    flags `augment` (auto_augment, random_erase)."""
    config = Config(img_size=img_size, batch_size=batch_size, seed=seed, **augment)
    process, plan = Process(rank, world_size), planned(split, config, stored)
    built = run_statements(LAUNCH, "train_set", "train_set", config=config, plan=plan, process=process)
    built = run_statements(LAUNCH, "batches", "train_loader", config=config, plan=plan, process=process, device=CPU,
                           choice=choice, train_set=built["train_set"], val_set=built["val_set"])  # fmt: skip
    return built["train_loader"], built["val_loader"]


def planned(split, config: Config, stored: bool = True) -> SimpleNamespace:
    """What my_dataset.datasets reads of a run's plan: `split`, and its image store (`stored`: as a run makes it, in
    the session's store folder) or none."""
    plan = SimpleNamespace(split=split, store=None, images_line="")
    if stored:
        images = StoredImages(store_folder(None), decode_sides(config.img_size), None, fallback=None)
        images(split.train_images + split.val_images)
        plan.store, plan.images_line = images.path, images.line
    return plan


def model_as_trained(num_classes: int, choice=Choice(), sync_bn=False, distributed=False, compile=False, **options):
    """(the model as it is trained: in DDP wrapped, with SyncBatchNorm when `sync_bn`; compiled when `compile`,
    the model itself, for evaluating and saving): ResNet-34 (or options["model"]), seeded with 0, on the CPU (or
    options["device"]); other `options` are Config fields."""
    device = options.pop("device", CPU)
    config = Config(model=options.pop("model", "resnet34"), seed=0, sync_bn=sync_bn, compile=compile, **options)
    plan = SimpleNamespace(split=SimpleNamespace(classes=range(num_classes)), weights=None)
    built = run_statements(LAUNCH if distributed else SINGLE, "model", "trained", config=config, plan=plan,
                           device=device, choice=choice)  # fmt: skip
    return built["trained"], built["model"]


def training_as_built(config: Config, plan, trained, model, train_loader, device, choice: Choice) -> Training:
    """The Training of train_single_gpu.py's `train` (its optimizer, schedule, gradient scaler, loss and EMA) for
    `trained` (and its unwrapped `model`), a run of `config` on `plan.split` on `device` as `choice` says."""
    built = run_statements(SINGLE, "optimizer", "training", config=config, plan=plan, trained=trained, model=model,
                           train_loader=train_loader, device=device, choice=choice)  # fmt: skip
    return built["training"]


def resnet10(num_classes, name=None, norm_layer=None):
    """A ResNet of one block a stage (torchvision's ResNet class, as --model resnet18 builds it, with half its
    blocks): every kind of layer of the default ResNet-34 (convolutions, BatchNorm, the shortcuts' downsampling, the
    head) in 4.9 M weights, half of ResNet-18's. The tests whose proofs do not depend on the depth (float64 step
    comparisons, fake-CUDA steps) put it in create_model's place."""
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm_layer)


def group_norm_resnet10(num_classes, name=None):
    """The same network normalising each image alone (GroupNorm): no statistic crosses images."""
    return resnet10(num_classes, norm_layer=lambda channels: nn.GroupNorm(8, channels))


def built_once(create):
    """`create`, each network built once and copied after: create(num_classes, *args) for each argument list and
    default dtype (initial_model seeds every build alike, and a large or float64 network takes a while to
    initialise; a copy is a fraction of that)."""
    built = {}

    def copy_of(num_classes, *args):
        key = (num_classes, *args, torch.get_default_dtype())
        if key not in built:
            built[key] = create(num_classes, *args)
        return copy.deepcopy(built[key])

    return copy_of
