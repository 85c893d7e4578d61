"""One gate for every value: whatever enters a run's configuration (the command line, a --config file, a
checkpoint's record, a launcher's environment variables) passes the same type, range and finiteness checks and is
refused in one line naming where it came from. Hypothesis generates the values, for every flag and every source;
the examples are bounded and drawn from a fixed seed, so the suite is the same every time."""

import json
import math
import os
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multi_train_utils.distributed_utils import launcher_environment
from run.config import SCRIPTS, Config, parse_config
from run.plan import run_record
from utils import UserError

pytestmark = pytest.mark.fast
EXAMPLES = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))

FLAGS = {f.name: f for f in fields(Config) if f.metadata.get("scripts")}
SWITCHES = {name for name, f in FLAGS.items() if f.metadata["argparse"].get("action") is not None}
# What a user types, and what a JSON file holds: numbers at and around every bound, the values nan and inf, words.
NUMBERS = st.one_of(
    st.integers(-3, 3),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 0.5, -0.0, 1e-300, 1e300]),
)
WORDS = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e9999", "", "none", "auto", "sgd", "resnet18"]), st.text())
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, WORDS), lambda inner: st.lists(inner, max_size=2), max_leaves=3
)


def typed(name: str, value) -> list[str] | None:
    """The words a user types to give flag `name` the JSON value `value`, or None where no typing gives it."""
    option = "--" + name.replace("_", "-")
    if name in SWITCHES:
        if value is None and Config.default(name) is None:
            return []
        if not isinstance(value, bool):
            return None
        no_form = FLAGS[name].metadata["argparse"]["action"] != "store_true"
        return [option] if value else (["--no-" + option[2:]] if no_form else [])
    if value is None:
        return [] if Config.default(name) is None else None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    return [f"{option}={repr(value) if isinstance(value, float) else value}"]


def verdict(call):
    """(True, the Config) or (False, the one line refusing it); any other exception fails the test."""
    try:
        return True, call()
    except UserError as refusal:
        assert "\n" not in str(refusal)
        return False, str(refusal)


def assert_checked(config: Config) -> None:
    """An admitted Config: every number finite, and the record of it admitted again unchanged."""
    assert all(math.isfinite(v) for v in vars(config).values() if isinstance(v, float))
    assert Config.from_record(json.loads(json.dumps(config.record())), "its record") == config


@EXAMPLES
@given(st.sampled_from(SCRIPTS), st.sampled_from(sorted(FLAGS)), st.one_of(NUMBERS.map(repr), WORDS))
def test_any_text_typed_for_any_flag_is_admitted_checked_or_refused_in_one_line(script, name, text):
    if script not in FLAGS[name].metadata["scripts"] or name in SWITCHES:
        return
    accepted, config = verdict(lambda: parse_config(script, "", [f"--{name.replace('_', '-')}={text}"]))
    if accepted:
        assert_checked(config)


@EXAMPLES
@given(st.sampled_from(sorted(set(Config.recipe_fields()) | {"data_path", "demo"})), JSON_VALUES)
def test_a_config_file_admits_a_value_exactly_when_the_command_line_admits_it_typed(tmp_path_factory, name, value):
    config_file = tmp_path_factory.mktemp("config") / "args.json"
    config_file.write_text(json.dumps({name: value}))
    from_file = verdict(lambda: parse_config("train_multi_gpu_using_launch", "", ["--config", str(config_file)]))
    words = typed(name, value)
    typed_in = verdict(lambda: parse_config("train_multi_gpu_using_launch", "", words)) if words is not None else None
    if typed_in is None:
        assert not from_file[0], f"{name}={value!r} admitted from a file, though no typing gives it"
    else:
        assert from_file[0] == typed_in[0], (from_file, typed_in)
        if from_file[0]:
            assert from_file[1] == typed_in[1]
            assert_checked(from_file[1])
    if not from_file[0]:  # the file named, unless the refusal is of two flags together, as typed (--warmup-epochs)
        assert f"--{name.replace('_', '-')}" in from_file[1]
        assert f"--config {config_file}" in from_file[1] or from_file[1] == typed_in[1]


@EXAMPLES
@given(st.sampled_from(sorted(FLAGS)), JSON_VALUES, st.one_of(NUMBERS, WORDS))
def test_a_checkpoints_record_is_admitted_by_the_same_checks_or_refused_naming_the_checkpoint(name, value, processes):
    state = {"args": {name: value, "recipe_world_size": processes}, "world_size": 2}
    accepted, saved = verdict(lambda: run_record("run/checkpoint.pth", state))
    words = typed(name, value)
    typed_ok = words is not None and verdict(lambda: parse_config("train_multi_gpu_using_launch", "", words))[0]
    whole = isinstance(processes, int | str) and not isinstance(processes, bool) and str(processes).strip().isdigit()
    counts_ok = not processes or (whole and int(processes) >= 1)  # none recorded (0, "", None): the run's own
    assert accepted == (typed_ok and counts_ok), (state, saved)
    if accepted:
        assert saved["world_size"] == 2 and saved["recipe_world_size"] == (int(processes) if processes else 2)
    else:
        assert saved.startswith("checkpoint run/checkpoint.pth")


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
ENVIRONMENT_WORDS = WORDS.filter(lambda text: "\x00" not in text and text.isprintable())  # what an environment holds


def launcher_verdict(texts: tuple) -> tuple:
    """verdict of launcher_environment with the launcher's variables set to `texts`, the environment restored."""
    saved = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    try:
        os.environ.update(dict(zip(LAUNCHER_VARIABLES, texts, strict=True)))
        return verdict(launcher_environment)
    finally:
        for name, text in saved.items():
            os.environ.pop(name) if text is None else os.environ.__setitem__(name, text)


@EXAMPLES
@given(st.tuples(*[st.integers(-1, 4) for _ in LAUNCHER_VARIABLES]))
def test_a_launchers_counts_are_admitted_exactly_when_they_describe_a_job(counts):
    rank, world_size, local_rank, local_world_size = counts
    accepted, found = launcher_verdict(tuple(map(str, counts)))
    assert accepted == (0 <= rank < world_size and 0 <= local_rank < local_world_size), found
    if accepted:
        assert found == dict(zip(("rank", "world_size", "local_rank", "local_world_size"), counts, strict=True))
    else:
        assert found.startswith("environment variable ") and any(name in found for name in LAUNCHER_VARIABLES)


@EXAMPLES
@given(st.tuples(*[st.one_of(st.integers(-2, 9).map(str), ENVIRONMENT_WORDS) for _ in LAUNCHER_VARIABLES]))
def test_any_text_in_a_launchers_variables_is_a_job_or_one_line_naming_the_variable(texts):
    accepted, found = launcher_verdict(texts)
    if accepted:
        assert 0 <= found["rank"] < found["world_size"] and 0 <= found["local_rank"] < found["local_world_size"]
    else:
        assert found.startswith("environment variable ") and any(name in found for name in LAUNCHER_VARIABLES)


def test_nan_and_infinity_are_refused_from_the_command_line_and_from_a_config_file(tmp_path, run_main):
    (tmp_path / "args.json").write_text('{"lr": NaN}')  # Python's json writes and reads NaN
    for flags in (["--lr", "nan"], ["--momentum", "inf"], ["--config", tmp_path / "args.json"]):
        result = run_main("train_single_gpu.py", "--demo", "--output-dir", tmp_path / "out", *flags)
        assert result.returncode == 2 and "must be a finite number" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
