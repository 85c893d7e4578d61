"""How long an epoch's first batch keeps the training loop waiting, with the loader as the scripts build it and as
it was before (the same DataLoader, its workers persistent, its next pass started only when asked for).

    python tools/epoch_starts.py [--data-path DEMO] [--workers 1] [--epochs 4] [--img-size 48] [--batch-size 32]

For each way, in turns, the loop of train_single_gpu.py reduced to what times it: each epoch's batches of the
loader path (--batches loader), each trained on by ResNet-18 (forward, backward, an SGD step), then a validation pass
over the validation loader; per epoch from the second, the seconds the loop waited for its first batch and the median
wait for the batches after it (the first epoch starts the workers: left out). On a GPU the steps run ahead of the
host, and an epoch's first batch is the whole of its wait; on the CPU the steps take the cores the workers load on.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's modules, run from anywhere
from dataset.ahead import EpochsAhead  # noqa: E402
from dataset.demo import DEMO_DATA_PATH, make_demo_data  # noqa: E402
from dataset.folders import read_split_data  # noqa: E402
from dataset.transforms import normalise  # noqa: E402
from multi_train_utils.distributed_utils import shuffled_batches  # noqa: E402
from my_dataset import datasets  # noqa: E402
from recipe.config import parse_config  # noqa: E402


def waits(train_loader, val_loader, batches, model, optimizer, epochs: int) -> list[tuple[float, float]]:
    """(first batch's wait, median later wait) in seconds, for each epoch from the second."""
    found = []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        model.train()
        seconds, asked = [], time.perf_counter()
        for images, labels in train_loader:
            seconds.append(time.perf_counter() - asked)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(normalise(images)), labels.clamp(min=0)).backward()
            optimizer.step()
            asked = time.perf_counter()
        model.eval()
        with torch.no_grad():
            for images, _ in val_loader:
                model(normalise(images))
        if epoch:
            found.append((seconds[0], statistics.median(seconds[1:])))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-path", default=None)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    data = args.data_path or make_demo_data(DEMO_DATA_PATH)
    config = parse_config(
        "train_single_gpu", "", ["--img-size", str(args.img_size), "--batch-size", str(args.batch_size)]
    )
    train_set, val_set, _ = datasets(read_split_data(data), config)
    loading = {"num_workers": args.workers, "persistent_workers": True}
    torch.set_num_threads(max(1, torch.get_num_threads() - args.workers))
    for turn in range(2):
        for name, wrap in (("as before", lambda loader: loader), ("epochs ahead", EpochsAhead)):
            torch.manual_seed(0)
            model = torchvision.models.resnet18(num_classes=5)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            batches = shuffled_batches(train_set, args.batch_size, seed=0)
            train_loader = wrap(DataLoader(train_set, batch_sampler=batches, **loading))
            val_loader = wrap(DataLoader(val_set, batch_size=args.batch_size, **loading))
            found = waits(train_loader, val_loader, batches, model, optimizer, args.epochs)
            first = statistics.median(wait for wait, _ in found)
            later = statistics.median(wait for _, wait in found)
            print(
                f"turn {turn}, {name}: an epoch's first batch {first * 1000:.1f} ms, later ones {later * 1000:.1f} ms"
            )


if __name__ == "__main__":
    main()
