"""Words that are true: every file, test, function and flag that the README, docs/ and the code's comments name
exists. A name that outlives its code misleads the reader who follows it."""

import ast
import importlib
import io
import re
import subprocess
import sys
import tokenize
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dataset", "recipe", "run", "multi_train_utils", "autotune", "inference", "network")
# Other programs' flags that the docs and comments name alone: torchrun's (and torch.distributed.launch's), SLURM's,
# pytest-xdist's; and torch's names beyond what `torch.` resolves (an environment variable, a DDP hook).
EXTERNAL_FLAGS = {
    "--nproc_per_node", "--nnodes", "--node_rank", "--master_port", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend",
    "--redirects", "--tee", "--use_env",
    "--signal", "--gpus-per-node", "--gpus-per-task", "--gpu-bind", "--mem", "--mem-per-cpu",
    "--dist",
}  # fmt: skip
EXTERNAL_NAMES = {"bf16_compress_hook", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"}
# timm's train.py, the top of a pytorch-image-models checkout, never committed here (the benchmark's timm row; a GPU
# session carries it as peers/timm_train.py)
EXTERNAL_FILES = {"train.py", "timm_train.py"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](?![\w-])")


@cache
def tracked(suffix: str) -> list[Path]:
    """The project's files ending in `suffix`: those git lists, or, outside a git checkout (an unpacked archive),
    every such file but in hidden folders and the ones runs write (runs/, data/)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:  # no git on this machine
        listed = None
    if listed is not None and listed.returncode == 0:
        # (a file deleted in the working tree is still in git's index)
        names = [name for name in listed.stdout.split() if (ROOT / name).is_file()]
    else:
        paths = [path.relative_to(ROOT) for path in ROOT.rglob(f"*{suffix}")]
        names = [path.as_posix() for path in paths if not any(part.startswith(".") for part in path.parts)]
        names = [name for name in names if name.split("/")[0] not in ("runs", "data")]
    return [ROOT / name for name in names if name.endswith(suffix) and not name.startswith(".venv")]


@cache
def code_words() -> frozenset[str]:
    """Every name and every word in a string literal of the project's Python and shell files (but the breaks of
    tests/break_guarantees.py, code written wrong on purpose)."""
    words = set()
    for path in (path for path in tracked(".py") if path.name != "break_guarantees.py"):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type in (tokenize.NAME, tokenize.STRING):
                words.update(re.findall(r"[A-Za-z_]\w*", token.string))
    for path in tracked(".sh"):
        words.update(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    return frozenset(words)


@cache
def project_flags() -> frozenset[str]:
    """Every flag a script of the project takes: the training scripts' from Config's fields (each with its --no-
    form), the others' as their parsers spell them."""
    flags = set()
    for path in tracked(".py"):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.STRING:
                flags.update(re.findall(r'^[rbf]*["\'](--[a-z][a-z0-9-]*)["\']$', token.string))
    config = next(node for node in ast.parse((ROOT / "run/config.py").read_text()).body if is_class(node, "Config"))
    for field in (node.target.id for node in config.body if isinstance(node, ast.AnnAssign)):
        flags |= {f"--{field.replace('_', '-')}", f"--no-{field.replace('_', '-')}"}
    return frozenset(flags | {"--config", "--help"})


def is_class(node, name: str) -> bool:
    return isinstance(node, ast.ClassDef) and node.name == name


@cache
def known_tests() -> frozenset[str]:
    """The tests, and their files' names (test_training, ...)."""
    files = {path.stem for path in tracked(".py") if path.stem.startswith("test_")}
    return frozenset(re.findall(r"^def (test_\w+)", "".join(p.read_text() for p in tracked(".py")), re.M)) | files


@cache
def defined_in(module: Path) -> frozenset[str]:
    """The names a module defines, at any depth (its classes' members too): not those it imports, so that a name
    is looked for where it lives."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return frozenset(names)


def file_exists(name: str, near: Path = ROOT) -> bool:
    """A path from the root, from tests/ or from `near`'s folder; or the name of one file of the project."""
    if (
        Path(name).name in EXTERNAL_FILES
        or (ROOT / name).exists()
        or (ROOT / "tests" / name).exists()
        or (near.parent / name).exists()
    ):
        return True
    return "/" not in name and any(path.name == name for path in tracked(name))


LIBRARIES = {"torch", "torchvision", *sys.stdlib_module_names}


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module, or an attribute of one, that imports here."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part, None)
        return found is not None
    return False


def missing_in_span(span: str) -> list[str]:
    """What a backticked span of the docs names that does not exist: a .py file (with ::test), a test, a function
    or other name (with an underscore, a dot or parentheses), a flag of a project script."""
    missing = []
    for path, _, test in (found.partition("::") for found in re.findall(r"[\w./-]+\.py(?:::\w+)?", span)):
        if not file_exists(path) or test and test not in known_tests():
            missing.append(f"{path}::{test}" if test else path)
    missing += [name for name in re.findall(r"\btest_\w*[a-z0-9]\b", span) if name not in known_tests()]
    name = re.fullmatch(r"([A-Za-z_][\w.]*\w)(\(.*\))?", span.strip())
    if name and ("_" in name[1] or "." in name[1] or name[2]) and not re.search(r"\.(md|json|jsonl|pth|png)$", name[1]):
        missing += qualified_missing(name[1], ROOT_MODULES)
        parts = name[1].split(".")
        if parts[0] in LIBRARIES and "." in name[1]:  # torch's, or Python's own: it must resolve
            missing += [] if resolves(name[1]) else [name[1]]
        elif not all(part in code_words() for part in parts) and name[1] not in EXTERNAL_NAMES:
            missing.append(name[1])
    words = span.split()
    scripts = [at for at, word in enumerate(words) if word.endswith(".py")]
    ours = words[scripts[-1] + 1 :] if scripts else words if span.startswith("--") else []
    flags = (FLAG.match(word) for word in ours)
    missing += [f[0] for f in flags if f and f[0] not in project_flags() and f[0] not in EXTERNAL_FLAGS]
    return missing


DOCS = ["README.md", *sorted(path.name for path in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS)
def test_every_file_test_function_and_flag_a_page_names_exists(page):
    text = (ROOT / page if page == "README.md" else ROOT / "docs" / page).read_text()
    # Each line of a block of code as a span of its own
    text = re.sub(
        r"```.*?```",
        lambda block: "\n".join(f"`{line}`" for line in block[0].strip("`").splitlines()),
        text,
        flags=re.S,
    )
    missing = sorted({name for span in re.findall(r"`([^`\n]+)`", text) for name in missing_in_span(span)})
    assert not missing, f"{page} names what does not exist: {missing}"


def stale_paths(page: Path) -> list[str]:
    """The links of a page (README.md, docs/) to files that do not exist, and the project files it names anywhere,
    backticked or not (a .py, .sh or .sbatch path), that do not exist."""
    text = page.read_text()
    links = [target for target in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"[a-z]+:", target)]
    missing = [target for target in links if not (page.parent / target).exists()]
    named = re.findall(r"(?<![\w/.:-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|sbatch))\b", re.sub(r"https?://\S+", "", text))
    return missing + [name for name in named if not file_exists(name, page)]


@pytest.mark.parametrize("page", DOCS)
def test_no_page_names_a_file_or_links_a_page_that_does_not_exist(page):
    assert stale_paths(ROOT / page if page == "README.md" else ROOT / "docs" / page) == []


def test_the_stale_path_check_finds_a_moved_file_and_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See run/autotune.py and [the map](code-map.md), [flags](flags.md); `train_single_gpu.py`.\n")
    (tmp_path / "flags.md").write_text("")
    assert stale_paths(page) == ["code-map.md", "run/autotune.py"]


def comments_and_docstrings(path: Path) -> list[str]:
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.COMMENT or token.type == tokenize.STRING and token.string.endswith(('"""', "'''")):
            found.append(token.string)
    return found


def missing_in_comment(text: str, path: Path) -> list[str]:
    """What a comment or docstring names that does not exist: a .py file, a test, a flag of a project script, a
    name qualified by a module of the project (my_dataset.MyDataSet, run.plan.prepare, ...)."""
    missing = [name for name in re.findall(r"(?<![\w/.])[\w/]+\.py\b", text) if not file_exists(name, path)]
    missing += [name for name in re.findall(r"\btest_\w*[a-z0-9]\b", text) if name not in known_tests()]
    missing += [flag for flag in FLAG.findall(text) if flag not in project_flags() and flag not in EXTERNAL_FLAGS]
    return missing + qualified_missing(text, ("my_dataset",))


# The top-level modules, but `model`: the docs also write model.method for the network object
ROOT_MODULES = tuple(path.stem for path in ROOT.glob("*.py") if path.stem != "model")


def qualified_missing(text: str, modules: tuple[str, ...]) -> list[str]:
    """The names in `text` qualified by a module of the project (one of `modules` at the top, or one in a package:
    run.plan.prepare) that the module does not define."""
    missing = []
    for module, name in re.findall(rf"\b((?:{'|'.join(PACKAGES)})\.\w+|{'|'.join(modules)})\.(\w+)\b", text):
        source = ROOT / f"{module.replace('.', '/')}.py"
        if name != "py" and (not source.exists() or name not in defined_in(source)):
            missing.append(f"{module}.{name}")
    return missing


@pytest.mark.parametrize("path", tracked(".py"), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_file_test_flag_and_qualified_name_a_comment_names_exists(path):
    missing = sorted({name for text in comments_and_docstrings(path) for name in missing_in_comment(text, path)})
    assert not missing, f"{path.relative_to(ROOT)}'s comments name what does not exist: {missing}"


def test_every_break_of_break_guarantees_names_text_that_is_there_once_and_a_test_that_exists():
    # a break whose text has moved on would stop the script ("update this script"), found only when it is run
    sys.path.insert(0, str(ROOT / "tests"))
    import break_guarantees

    for name, path, text, _, test in break_guarantees.BREAKS:
        assert (ROOT / path).read_text().count(text) == 1, f"break {name}: its text is not in {path} exactly once"
        file, _, function = test.partition("::")
        assert f"def {function.split('[')[0]}(" in (ROOT / file).read_text(), f"break {name}: no test {test}"
