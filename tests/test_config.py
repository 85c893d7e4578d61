"""The configuration: the flags as one frozen Config, its recipe fields, and a run's record loading back."""

import dataclasses
import json
from pathlib import Path

import pytest

from run.config import SINGLE, Config, parse_config
from utils import UserError

pytestmark = pytest.mark.fast


def test_the_recipe_is_what_decides_the_computation_and_nothing_about_speed_or_place():
    recipe = set(Config.recipe_fields())
    assert {"model", "epochs", "batch_size", "lr", "seed", "img_size", "sync_bn", "accumulate", "val_rate"} <= recipe
    assert not recipe & {"amp", "channels_last", "workers", "device", "output_dir", "resume", "compile", "data_path"}


def test_a_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_config(SINGLE, "", []).epochs = 3


def test_a_runs_record_loads_back_into_the_same_config(tmp_path):
    config = parse_config(SINGLE, "", ["--data-path", str(tmp_path), "--epochs", "3", "--output-dir", "out"])
    record = json.loads(json.dumps(config.record()))  # as args.json holds it
    assert Config.from_record(record, "args.json") == config
    assert Config.from_record({"epochs": 3, "not_a_flag": 1}, "args.json") == Config(
        epochs=3
    )  # unknown keys are ignored


def test_config_repeats_a_runs_recipe_and_data_and_the_command_line_still_wins(tmp_path):
    run = parse_config(
        SINGLE, "", ["--data-path", "flowers", "--lr", "0.05", "--epochs", "7", "--seed", "4", "--amp", "off"]
    )
    args_json = tmp_path / "args.json"
    args_json.write_text(json.dumps(run.record(output_dir="runs/first")))
    again = parse_config(SINGLE, "", ["--config", str(args_json), "--epochs", "9"])
    assert (again.lr, again.seed, again.data_path) == (0.05, 4, Path("flowers"))  # the run's recipe and data
    assert again.epochs == 9  # the flag given wins
    assert again.amp == "auto" and again.output_dir is None  # speed and place are this run's own


def test_an_unreadable_config_file_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read --config"):
        parse_config(SINGLE, "", ["--config", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(UserError, match="is not a run's args.json"):
        parse_config(SINGLE, "", ["--config", str(tmp_path / "bad.json")])
