"""The copies of the scripts' wiring cannot drift: tests/wiring.py and tools/benchmark.py build their loaders and
models with the scripts' own statements, and the scripts differ only where the README says they do."""

import ast
import difflib
import re
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SINGLE, LAUNCH, SPAWN = "train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py"
COPIES = {
    "tests/wiring.py": ["loaders", "model_as_trained", "training_as_built"],
    "tools/benchmark.py": ["training_loader", "_profile"],
}
# A block copied from a script: the lines between these two comments (the script's name in both)
BLOCK = re.compile(r"^[ \t]*# statement for statement: (\S+)\n(.*?)^[ \t]*# end of \1\n", re.M | re.S)


def function_source(path: str, name: str) -> str:
    source = (ROOT / path).read_text()
    node = next(node for node in ast.parse(source).body if getattr(node, "name", None) == name)
    return ast.get_source_segment(source, node, padded=True)


def statements(code: str) -> list[str]:
    """Each top-level statement of `code`, as its syntax tree: the same code in other words (spacing, line breaks,
    comments) gives the same list."""
    return [ast.dump(node) for node in ast.parse(textwrap.dedent(code)).body]


def train_statements(script: str) -> list[str]:
    """The statements of the script's `train`, top-level and in its with and for blocks, in order."""
    node = ast.parse(function_source(script, "train").strip()).body[0]
    found, todo = [], list(node.body)
    while todo:
        statement = todo.pop(0)
        found.append(ast.dump(statement))
        if isinstance(statement, ast.With | ast.For):
            todo[:0] = statement.body
    return found


def copied_blocks() -> list[tuple[str, str, str]]:
    """(where, the script it copies, the block's code) for every copied block."""
    return [
        (f"{path}:{name}", script, code)
        for path, names in COPIES.items()
        for name in names
        for script, code in BLOCK.findall(function_source(path, name))
    ]


def contains_run(whole: list[str], part: list[str]) -> bool:
    return any(whole[start : start + len(part)] == part for start in range(len(whole) - len(part) + 1))


def test_every_copy_of_the_wiring_is_marked_and_names_a_script():
    blocks = copied_blocks()
    assert {where for where, _, _ in blocks} == {f"{path}:{name}" for path, names in COPIES.items() for name in names}
    assert {script for _, script, _ in blocks} == {SINGLE, LAUNCH}
    assert all(statements(code) for _, _, code in blocks)


@pytest.mark.parametrize("where, script, code", copied_blocks(), ids=lambda value: str(value)[:40])
def test_a_copied_block_is_statement_for_statement_in_its_scripts_train(where, script, code):
    assert contains_run(train_statements(script), statements(code)), (
        f"{where} no longer builds what {script}'s train builds: copy the script's statements again"
    )


def test_the_two_ddp_scripts_train_alike():
    """Their `train` functions are one text, comments included: the launch (`main`, `worker`) is their only
    difference."""
    assert function_source(LAUNCH, "train") == function_source(SPAWN, "train")


def changed_lines(before: str, after: str) -> list[list[str]]:
    """The lines of `after` in each place it differs from `before` (with the line above, where it only drops)."""
    old, new = before.splitlines(), after.splitlines()
    hunks = difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes()
    return [new[max(0, j1 - (j1 == j2)) : max(j2, j1 + 1)] for tag, _, _, j1, j2 in hunks if tag != "equal"]


@pytest.mark.parametrize("function", ["main", "train"])
def test_every_line_the_launch_script_changes_says_which_ddp_concept_it_is(function):
    """`diff train_single_gpu.py train_multi_gpu_using_launch.py` is the lesson: in `main` and `train`, every
    place the torchrun script differs says "DDP" in its comment, or is the script's name."""
    hunks = changed_lines(function_source(SINGLE, function), function_source(LAUNCH, function))
    assert hunks
    for lines in hunks:
        if all(SINGLE.removesuffix(".py") in line or LAUNCH.removesuffix(".py") in line for line in lines):
            continue  # parse_config's script name
        assert any("DDP" in line for line in lines), "\n".join(lines)
