"""The product's size, and what a reader reads to follow one training step (docs/code-map.md).

python tools/code_size.py          # lines of Python and shell git holds, tests and docs aside, by folder
python tools/code_size.py --step   # the files and lines of one step, and of where its batch comes from
"""

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One step, batch in hand to weights updated: the functions it runs, by file (bookkeeping.py's stay behind named calls)
STEP = {
    "multi_train_utils/train_eval_utils.py": ["train_one_epoch", "Choice.batch_to", "Choice.autocast",
                                              "Choice.grad_scaler", "synchronised", "optimizer_step"],
    "dataset/transforms.py": ["normalise", "normalising_constants"],
    "recipe/loss.py": ["Objective.mix", "Objective.pieces", "Objective.targets", "Objective.loss_sum"],
    "multi_train_utils/memory.py": ["out_of_memory"],
    "recipe/optimizer.py": ["schedule_factor", "ExponentialMovingAverage.update_parameters"],
}  # fmt: skip
# Where its batch comes from, on either path: made on the device, or by loader processes
BATCH = {
    "device": {
        "dataset/on_device.py": ["TrainingBatches.__iter__", "TrainingBatches.plan", "TrainingBatches.gather",
                                 "TrainingBatches.crops", "TrainingBatches.stream", "TrainingBatches.arrived",
                                 "gather_boxes", "resampled_by_matrices", "resampling_weights"],
        "dataset/transforms.py": ["normalise_pixels"],
        "dataset/crop_boxes.py": ["mt19937_words", "uniform", "draw", "close_to_half"],
        "dataset/sampling.py": ["SeededBatchSampler.__iter__", "sample_seeds", "seed_hash", "seed_mix"],
    },
    "loader": {
        "my_dataset.py": ["EpochsAhead.__iter__", "MyDataSet.__getitem__"],
        "dataset/store.py": ["DecodedImages.__getitem__"],
        "dataset/sampling.py": ["SeededBatchSampler.__iter__", "sample_seeds", "seed_hash", "seed_mix"],
    },
}  # fmt: skip


def product_lines() -> Counter:
    """Lines of each folder at the top (or "." for the modules there), from the files git holds."""
    listed = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True)
    sizes = Counter()
    for name in listed.stdout.split():
        parts = Path(name).parts
        if parts[0] not in ("tests", "docs") and (ROOT / name).exists():
            sizes[parts[0] if len(parts) > 1 else "."] += len((ROOT / name).read_bytes().splitlines())
    return sizes


def function_lines(path: Path, names: list[str]) -> dict[str, int]:
    """The lines of each named function of `path` ("Class.method" for a method), its docstring included."""
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        inside = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for function in inside:
            if isinstance(function, ast.FunctionDef) and prefix + function.name in names:
                found[prefix + function.name] = function.end_lineno - function.lineno + 1
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{path.relative_to(ROOT)} has no {', '.join(sorted(missing))}: update tools/code_size.py")
    return found


def reading_path(files: dict[str, list[str]]) -> dict[str, int]:
    """Lines read in each file of a path."""
    return {name: sum(function_lines(ROOT / name, functions).values()) for name, functions in files.items()}


def main() -> None:
    if "--step" not in sys.argv:
        sizes = product_lines()
        for folder, lines in sizes.most_common():
            print(f"{lines:6d}  {folder}")
        print(f"{sum(sizes.values()):6d}  in all")
        return
    for title, files in [("one step", STEP), *((f"its batch, {way}", path) for way, path in BATCH.items())]:
        read = reading_path(files)
        more = "" if files is STEP else f" ({len(set(read) - set(STEP))} files beside the step's)"
        print(f"{title}: {len(read)} files{more}, {sum(read.values())} lines")
        for name, lines in read.items():
            print(f"  {lines:4d}  {name}")


if __name__ == "__main__":
    main()
