"""Imports point down. The project's places (a folder, or a module at the top) stand in the layers below, top first;
a place imports only places of the layers under its own, so no import runs back up and no two folders import each
other; and no module imports itself back through others. docs/code-map.md draws the same layers."""

import ast
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ["train_single_gpu.py", "train_multi_gpu_using_launch.py", "train_multi_gpu_using_spawn.py", "predict.py",
     "evaluate.py", "export.py", "tools"],  # the entry scripts and tools
    ["inference", "autotune"],  # scoring with a trained run; what auto chooses, measured
    ["run"],  # the run around the loop: its flags, its checked plan, what it writes and tracks
    ["multi_train_utils"],  # the training engine and the distributed helpers
    ["recipe"],  # the optimizer and its schedule, the loss
    ["my_dataset.py", "model.py"],  # the dataset and the network, as the scripts build them
    ["dataset", "network"],  # their parts
    ["plot_results.py"],
    ["read_back.py", "machine.py"],
    ["utils.py"],
]  # fmt: skip


def product_modules(root: Path) -> dict[str, Path]:
    """Every Python module of the product (tests and docs aside), by its dotted name."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    paths = [root / name for name in listed if name.split("/")[0] not in ("tests", "docs") and (root / name).exists()]
    return {str(path.relative_to(root).with_suffix("")).replace("/", ".").removesuffix(".__init__"): path
            for path in paths}  # fmt: skip


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def place(module: str, modules: dict[str, Path], root: Path) -> str:
    """The folder at the top that holds `module`, or its file there."""
    relative = modules[module].relative_to(root)
    return relative.parts[0] if len(relative.parts) > 1 else relative.name


def upward_imports(root: Path, layers=LAYERS) -> list[str]:
    """Every import from one place to another that is not to a layer below its own, and every place in no layer."""
    modules = product_modules(root)
    layer_of = {name: depth for depth, names in enumerate(layers) for name in names}
    problems = sorted({f"{place(m, modules, root)} is in no layer" for m in modules} - {
        f"{name} is in no layer" for name in layer_of})  # fmt: skip
    for module, path in modules.items():
        here = place(module, modules, root)
        for target in imports(path, modules):
            there = place(target, modules, root)
            if there != here and there in layer_of and here in layer_of and layer_of[there] <= layer_of[here]:
                problems.append(f"{module} imports {target}: {there} is not below {here}")
    return sorted(problems)


def import_cycles(root: Path) -> list[list[str]]:
    """The cycles of the modules' import graph (each module that leads back to itself, with the way it does)."""
    modules = product_modules(root)
    graph = {module: sorted(imports(path, modules)) for module, path in modules.items()}
    cycles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                cycles.append([*trail[trail.index(target) :], target] if target in trail else [module, target])
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    return cycles


def test_every_import_points_down_a_layer():
    assert upward_imports(ROOT) == []


def test_no_module_imports_itself_back():
    assert import_cycles(ROOT) == []


def planted(tmp_path: Path, files: dict[str, str]) -> Path:
    """A small tree of `files` (path: text) in a git repository of its own."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def test_the_layer_check_finds_an_import_that_runs_up_and_folders_that_import_each_other(tmp_path):
    root = planted(tmp_path, {"top.py": "import low.a\n", "low/__init__.py": "", "low/a.py": "import mid.b\n",
                              "mid/__init__.py": "", "mid/b.py": "import low\n"})  # fmt: skip
    found = upward_imports(root, [["top.py"], ["mid"], ["low"]])
    assert found == ["low.a imports mid.b: mid is not below low"]
    assert upward_imports(root, [["top.py"], ["mid"]]) == ["low is in no layer"]


def test_the_cycle_check_finds_modules_that_import_each_other(tmp_path):
    root = planted(tmp_path, {"a.py": "from b import x\n", "b.py": "def f():\n    import c\n", "c.py": "import a\n"})
    assert import_cycles(root) == [["a", "b", "c", "a"]]
