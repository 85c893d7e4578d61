"""The code stays readable as it grows: no function longer than about a screen (60 lines) or taking more than 8
parameters, no module over 400 lines (tools/ included), train_one_epoch on one screen (35 lines) showing the batch's
whole tensor path and the step, and no stand-in namespaces (SimpleNamespace) outside the tests."""

import ast
from pathlib import Path

import pytest
from test_layers import planted, product_modules

from tools.code_size import BATCH, STEP, reading_path

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_MODULE_LINES, MAX_STEP_LINES = 60, 8, 400, 35
# What train_one_epoch shows of a step: the batch to the device, mixed, in micro-batches, forward, loss, backward, step
STEP_PARTS = ("batch_to(", ".mix(", ".pieces(", "model(", "loss_sum(", ".backward()", "optimizer_step(")


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def parameters(node: ast.FunctionDef) -> int:
    """Its parameters, self and cls aside (a *args or **kwargs counts as one)."""
    arguments = node.args
    names = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    return sum(1 for name in names if name is not None and name.arg not in ("self", "cls"))


def oversized(root: Path) -> list[str]:
    """Every function over MAX_FUNCTION_LINES lines or MAX_PARAMETERS parameters, and every module over
    MAX_MODULE_LINES lines, of the product (tests and docs aside)."""
    found = []
    for path in product_modules(root).values():
        name = path.relative_to(root)
        size = len(path.read_text(encoding="utf-8").splitlines())
        found += [f"{name}: {size} lines"] * (size > MAX_MODULE_LINES)
        for node in functions(path):
            found += [f"{name}:{node.name}: {lines(node)} lines"] * (lines(node) > MAX_FUNCTION_LINES)
            found += [f"{name}:{node.name}: {parameters(node)} parameters"] * (parameters(node) > MAX_PARAMETERS)
    return sorted(found)


def step_problems(path: Path) -> list[str]:
    """What train_one_epoch in `path` lacks of a step on one screen."""
    (function,) = [node for node in functions(path) if node.name == "train_one_epoch"]
    text = ast.get_source_segment(path.read_text(encoding="utf-8"), function)
    return [f"{lines(function)} lines"] * (lines(function) > MAX_STEP_LINES) + [
        f"no {part}" for part in STEP_PARTS if part not in text
    ]


def test_no_function_or_module_is_oversized():
    assert oversized(ROOT) == []


def test_train_one_epoch_shows_the_batchs_path_and_the_step_on_one_screen():
    assert step_problems(ROOT / "multi_train_utils" / "train_eval_utils.py") == []


def test_one_step_reads_through_6_files_and_400_lines_and_its_batch_through_3_more():
    """tools/code_size.py's reading path (docs/code-map.md): batch in hand to weights updated, and where the batch
    comes from on either path."""
    step = reading_path(STEP)
    assert len(step) <= 6 and sum(step.values()) <= 400, step
    for files in BATCH.values():
        assert len(set(reading_path(files)) - set(step)) <= 3, files


def test_no_stand_in_namespace_outside_the_tests():
    found = [path.relative_to(ROOT) for path in product_modules(ROOT).values() if "SimpleNamespace" in path.read_text()]
    assert found == []


def test_the_checks_find_what_is_planted(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    step = "def train_one_epoch(training):\n" + "    pass\n" * MAX_STEP_LINES + "    model(images).backward()\n"
    root = planted(tmp_path, {
        "tools/big.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
        "long.py": f"def long():\n{long_body}",
        "wide.py": "def wide(a, b, c, d, e, f, g, h, *, i):\n    pass\n",
        "method.py": "class A:\n    def fine(self, a, b, c, d, e, f, g, h):\n        pass\n",
        "step.py": step,
    })  # fmt: skip
    assert oversized(root) == [
        "long.py:long: 61 lines",
        f"tools/big.py: {MAX_MODULE_LINES + 1} lines",
        "wide.py:wide: 9 parameters",
    ]
    assert step_problems(root / "step.py") == [f"{MAX_STEP_LINES + 2} lines", *(
        f"no {part}" for part in STEP_PARTS if part not in ("model(", ".backward()"))]  # fmt: skip
