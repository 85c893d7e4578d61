"""The code stays readable as it grows: no function longer than about a screen (60 lines), no top-level module over
400 lines (the packages hold the parts: my_dataset.py keeps its in dataset/), the training loop of
train_one_epoch short enough (20 lines) to see its forward pass, loss, backward pass and optimizer step at once, and
no stand-in namespaces (SimpleNamespace) where a function takes a run's real configuration."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path for path in ROOT.rglob("*.py") if not {".venv", "data", "runs"} & set(path.relative_to(ROOT).parts)
)


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_is_over_60_lines():
    long = {
        f"{path.relative_to(ROOT)}:{node.name}": lines(node)
        for path in SOURCES
        for node in functions(path)
        if lines(node) > 60
    }
    assert long == {}


def test_no_top_level_module_is_over_400_lines():
    sizes = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in ROOT.glob("*.py")}
    assert {name: size for name, size in sizes.items() if size > 400} == {}


def test_train_one_epochs_loop_shows_forward_loss_backward_and_step_in_20_lines():
    path = ROOT / "multi_train_utils" / "train_eval_utils.py"
    (function,) = [node for node in functions(path) if node.name == "train_one_epoch"]
    (loop,) = [node for node in function.body if isinstance(node, ast.For)]
    text = ast.get_source_segment(path.read_text(encoding="utf-8"), loop)
    assert lines(loop) <= 20, text
    for part in ("model(", "loss", ".backward()", "optimizer_step("):
        assert part in text, part


def test_no_stand_in_namespace_outside_the_tests():
    found = [
        path.relative_to(ROOT)
        for path in SOURCES
        if "tests" not in path.parts and "SimpleNamespace" in path.read_text()
    ]
    assert found == []
