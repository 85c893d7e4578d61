"""The scripts differ only where the README says they do: the two DDP scripts' `train` is one text, and every line
the torchrun script changes of the single-process one says which DDP concept it is. (tests/wiring.py builds what
the tests check by running the scripts' own statements: there is no copy to drift.)"""

import ast
import difflib
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SINGLE, LAUNCH, SPAWN = "train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py"


def function_source(path: str, name: str) -> str:
    source = (ROOT / path).read_text()
    node = next(node for node in ast.parse(source).body if getattr(node, "name", None) == name)
    return ast.get_source_segment(source, node, padded=True)


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
