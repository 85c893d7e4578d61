"""predict.py's and evaluate.py's results file: a row per image in order, CSV or JSON Lines, whole or not at all."""

import argparse
import contextlib
import csv
import json
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from utils import STOP_SIGNALS, atomic_file, check_new_file, positive_int

FORMATS = (".csv", ".jsonl")
DECIMALS = 6  # of each probability: far below any difference between two classes worth reading


@dataclass
class Row:
    """One image's line: its top (name, probability), likeliest first, or, if it could not be read, why."""

    path: str
    true_class: str | None
    top: list[tuple[str, float]]
    unreadable: str | None = None

    def line(self) -> str:
        """What predict.py prints for it: `photo.jpg: daisy 0.998, roses 0.001, tulips 0.001`."""
        if self.unreadable is not None:
            return f"{self.path}: unreadable ({self.unreadable})"
        return f"{self.path}: " + ", ".join(f"{name} {probability:.3f}" for name, probability in self.top)


def results_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: name a .csv or a .jsonl file (its format follows the name)")
    return path


def add_results_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=results_path, metavar="FILE", help="write one row per image to FILE, .csv or "
                   ".jsonl: its path, true class where known, top classes with their probabilities, or why it could "
                   "not be read (see docs/trained-models.md)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace the --results file if it exists")
    p.add_argument("--topk", type=positive_int, default=3,
                   help="classes per image, likeliest first (at most all of them)")  # fmt: skip


def check_results_file(path: Path | None, force: bool) -> None:
    """UserError, before anything is computed, unless --results can be written (check_new_file)."""
    if path is not None:
        check_new_file(path, "--results", force)


def text(value) -> str:
    """`value` as JSON text, UTF-8 throughout: a name's bytes that are not UTF-8 (lone surrogates, utils.NAMES) as
    JSON's escapes \\udcXX, which json.loads turns back into the same str (os.fsencode: the same bytes)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace").decode("utf-8")


def cell(name: str) -> str:
    """A CSV cell for `name`: as it is, unless it is not UTF-8 or starts with a quote: then its JSON `text`."""
    utf8 = name.encode("utf-8", "replace").decode("utf-8") == name  # (a lone surrogate is replaced)
    return name if utf8 and not name.startswith('"') else text(name)


def name(value: str) -> str:
    """A name from its CSV cell, as docs/trained-models.md reads it."""
    return json.loads(value) if value.startswith('"') else value


class ResultsWriter:
    def __init__(self, file, topk: int, jsonl: bool):
        self.file, self.topk, self.jsonl, self.rows = file, topk, jsonl, 0
        if not jsonl:
            self.csv = csv.writer(file)  # RFC 4180's lines (CRLF): a name holding a CR or LF is quoted, read back whole
            ranked = [f"{column}_{rank}" for rank in range(1, topk + 1) for column in ("class", "probability")]
            self.csv.writerow(["path", "true_class", *ranked, "unreadable"])

    def write(self, rows: list[Row]) -> None:
        for row in rows:
            names, probabilities = [name for name, _ in row.top], [round(p, DECIMALS) for _, p in row.top]
            if self.jsonl:
                record = {"path": row.path, "true_class": row.true_class, "classes": names,
                          "probabilities": probabilities, "unreadable": row.unreadable}  # fmt: skip
                self.file.write(text(record) + "\n")
            else:
                ranked = [value for pair in zip(map(cell, names), probabilities, strict=True) for value in pair]
                ranked += [""] * (2 * self.topk - len(ranked))  # an unreadable image's classes: empty
                self.csv.writerow([cell(row.path), cell(row.true_class or ""), *ranked, cell(row.unreadable or "")])
        self.rows += len(rows)


class NoResults:
    """Where the rows go without --results, and on every process but rank 0: nowhere."""

    rows = 0

    def write(self, rows: list[Row]) -> None:
        pass


@contextlib.contextmanager
def results_file(path: Path | None, topk: int, enabled: bool = True):
    """A ResultsWriter for --results, its file there only if the block ends cleanly (no stop signal); else NoResults."""
    if path is None or not enabled:
        yield NoResults()
        return
    with unwinding_on_stop_signals(), atomic_file(path) as file:
        yield ResultsWriter(file, topk, jsonl=path.suffix.lower() == ".jsonl")


@contextlib.contextmanager
def unwinding_on_stop_signals():
    """Inside, a stop signal raises SystemExit(128 + signal): the blocks unwind, a half-written results file goes."""
    if threading.current_thread() is not threading.main_thread():  # Python runs handlers in the main thread alone
        yield
        return
    before = {signum: signal.signal(signum, lambda number, frame: sys.exit(128 + number)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def read_results(path: Path) -> list[dict]:
    """The rows of a results file, CSV or JSON Lines, each as JSON Lines writes it (None where a CSV cell is empty)."""
    with open(path, encoding="utf-8", newline="") as file:
        if path.suffix.lower() == ".jsonl":
            return [json.loads(line) for line in file]
        rows = []
        for cells in csv.DictReader(file):
            cells = {key: name(value) for key, value in cells.items()}
            ranks = range(1, sum(key.startswith("class_") for key in cells) + 1)
            ranked = [(cells[f"class_{r}"], cells[f"probability_{r}"]) for r in ranks if cells[f"class_{r}"]]
            rows.append({
                "path": cells["path"], "true_class": cells["true_class"] or None,
                "classes": [class_ for class_, _ in ranked], "probabilities": [float(p) for _, p in ranked],
                "unreadable": cells["unreadable"] or None,
            })  # fmt: skip
        return rows
