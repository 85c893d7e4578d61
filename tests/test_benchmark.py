"""tools/benchmark.py end to end at toy sizes: every row measured, the files written, the table and targets printed;
the rows --rows selects, each on disk before the next starts, and the targets of rows not measured."""

import json
import math
import os

import pytest
from conftest import SMALL_MODEL, run_script
from PIL import Image

from autotune.remembered import CACHE_ENV
from multi_train_utils.train_eval_utils import Choice
from tools import benchmark, compute_peak, fresh_rows, script_rows
from utils import UserError


def test_a_small_benchmark_measures_every_single_process_row_and_writes_its_files(tiny_data, tmp_path, run_main):
    out = tmp_path / "bench"
    result = run_script(
        "tools/benchmark.py",
        *("--data-path", tiny_data, "--output-dir", out, "--img-size", "32", "--batch-size", "8", *SMALL_MODEL),
        *("--epochs", "2", "--steps", "1", "--loader-images", "16", "--device", "cpu"),
        *("--rows", "model-only,loader,baseline,fixed"),  # no DDP, no demo; auto runs whatever --rows says
        *("--fixed", "float32-nchw"),  # one fixed configuration beside auto (each is a run of the script)
    )
    assert result.returncode == 0, result.stderr
    results = json.loads((out / "benchmark.json").read_text())
    rows = results["rows"]
    kinds = ["model-only"] * 2 + ["loader", "loader", "baseline", "fixed", "auto"]
    assert [row["kind"] for row in rows] == kinds
    assert results["settings"]["rows"] == list(dict.fromkeys(kinds)) and results["complete"] is True
    for row in rows:
        assert math.isfinite(row["img_per_sec"]) and row["img_per_sec"] > 0 and row["peak_rss_mib"] > 100
        if row["kind"] == "loader":  # loads images, trains nothing: no FLOPs
            assert row["peak_fraction"] is None
        else:
            assert 0 < row["peak_fraction"] < 1  # of the measured compute peak of its precision
    # one worker, then the training scripts' count on this machine as auto chose it (at least one)
    scripts = results["settings"]["workers"]
    assert [row["workers"] for row in rows[2:4]] == [1, max(1, scripts)]
    assert rows[2]["img_per_sec_per_worker"] == rows[2]["img_per_sec"]
    baseline, fixed, single = rows[-3:]
    assert baseline["precision"] == fixed["precision"] == "float32, NCHW" and single["epoch_seconds"] > 0
    # auto measured in its run, in the benchmark's own cache; the rows without a script computed as it chose
    assert single["measure_seconds"] > 0 and (out / "autotune.json").exists()
    assert rows[0]["precision"] == single["precision"] == results["settings"]["precision"]
    # each training row is a real run of the script, with its own metrics; the baseline restarts its loader
    # workers every epoch, as the original did (--no-persistent-workers)
    for name in ("auto", "baseline", "fixed-float32-nchw"):
        assert len((out / "runs" / name / "metrics.jsonl").read_text().splitlines()) == 2
    assert "2 loader workers per process" in (out / "logs" / "baseline.log").read_text()
    # the machine the figures hold for: processor, cores, the instruction set torch computes with, the peaks
    settings = results["settings"]
    assert "cores, torch kernels" in results["machine"] and settings["peak_flops"]["float32"] > 1e9
    # every row trains --model: the runs (their args.json), and the FLOPs the rows' peak fractions count
    assert settings["model"] == SMALL_MODEL[1] and result.stdout.startswith(f"Benchmark: {SMALL_MODEL[1]}, 32 px")
    for name in ("auto", "baseline", "fixed-float32-nchw"):
        assert json.loads((out / "runs" / name / "args.json").read_text())["model"] == SMALL_MODEL[1]
    flops = compute_peak.training_flops_per_image(SMALL_MODEL[1], 32)  # 0.22 GFLOP
    assert settings["training_flops_per_image"] == flops
    assert (
        "| train_single_gpu.py, auto (batches " in result.stdout
        and "Compute peak (the faster of matrix products and convolutions): float32" in result.stdout
    )
    assert "auto against the original's configuration (float32, NCHW): " in result.stdout
    assert "against the best fixed configuration (float32, NCHW): " in result.stdout
    assert "of the model-only ceiling" in result.stdout and "x the original's setup" in result.stdout
    assert "| loader, 1 worker | 1 | – |" in result.stdout and f"loader with {max(1, scripts)} worker" in result.stdout
    with Image.open(out / "benchmark.png") as png:
        assert png.format == "PNG" and png.width >= 600
    rerun = run_main("tools/benchmark.py", "--data-path", tiny_data, "--output-dir", out, "--skip-ddp")
    assert rerun.returncode == 2 and "already holds a benchmark" in rerun.stderr  # never overwrites


# What a script's run reports (run_script), for the tests below that measure nothing
AUTO_FIGURES = {"img_per_sec": 90.0, "epoch_seconds": 2.0, "first_epoch_seconds": 3.0, "run_seconds": 20.0,
                "val_acc": 0.5, "peak_rss_mib": 600, "measure_seconds": 4.0}  # fmt: skip


def fake_measurements(monkeypatch, out, fail_at=None) -> list[list[str]]:
    """tools/benchmark.py's measuring replaced by fixed figures (auto's run, the rows in fresh processes, the peaks
    and FLOPs), so that main runs in this process in moments. Returns a list that gets, as each row in a fresh
    process starts, the names of the rows then in out/benchmark.json; the row `fail_at` (counted from 0) fails."""
    on_disk = []

    def measure(name, target, *args):
        on_disk.append([row["name"] for row in json.loads((out / "benchmark.json").read_text())["rows"]])
        if len(on_disk) - 1 == fail_at:
            raise UserError(f"{name}: its process failed")
        return {"img_per_sec": 100.0, "peak_rss_mib": 500}

    monkeypatch.setattr(script_rows, "auto_run", lambda args: (dict(AUTO_FIGURES), Choice()))
    monkeypatch.setattr(fresh_rows, "in_fresh_process", measure)
    monkeypatch.setattr(benchmark, "measure_peaks", lambda computes, device: {"float32": 1e12})
    monkeypatch.setattr(benchmark, "training_flops_per_image", lambda model, img_size: 1e9)
    monkeypatch.setenv(CACHE_ENV, os.environ[CACHE_ENV])  # main points it at its own file: restored after the test
    return on_disk


def small_benchmark(tiny_data, out, *flags) -> list[str]:
    return ["--data-path", str(tiny_data), "--output-dir", str(out), "--img-size", "32", "--batch-size", "8",
            "--device", "cpu", *flags]  # fmt: skip


@pytest.mark.fast
def test_rows_selects_kinds_and_each_row_is_on_disk_before_the_next_starts(tiny_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    on_disk = fake_measurements(monkeypatch, out)
    benchmark.main(small_benchmark(tiny_data, out, "--rows", "model-only"))  # auto runs whatever --rows says
    auto = "train_single_gpu.py, auto (batches by the loader)"
    ceiling = "model only (the ceiling)"
    assert on_disk == [[auto], [ceiling, auto]]  # in the table's order, auto last
    results = json.loads((out / "benchmark.json").read_text())
    assert [row["kind"] for row in results["rows"]] == ["model-only"] * 2 + ["auto"]
    assert results["settings"]["rows"] == ["model-only", "auto"] and results["complete"] is True
    printed = capsys.readouterr().out
    # each row's line as it is measured; "× baseline" stays "–" without a baseline row
    assert printed.count("| model only (the ceiling) | 1 | float32, NCHW | 100.0 | – |") == 2  # then in the table
    assert "single process >= 90 % of the model-only ceiling: 90% (met)" in printed
    for target in (
        "the original's setup (float32 only)",
        "torchrun >= 0.8x one process",
        "the best fixed configuration",
    ):
        assert f"{target}: not measured" in printed


@pytest.mark.fast
def test_a_benchmark_stopped_midway_leaves_the_rows_it_finished(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "bench"
    fake_measurements(monkeypatch, out, fail_at=2)  # the third row of a fresh process (the compile row) fails
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(small_benchmark(tiny_data, out, "--skip-ddp", "--skip-demo"))
    assert stopped.value.code == 2
    results = json.loads((out / "benchmark.json").read_text())
    assert [row["kind"] for row in results["rows"]] == ["model-only", "model-only", "auto"]
    assert results["complete"] is False
    skipped = ("torchrun", "spawn", "demo")  # --skip-ddp, --skip-demo
    assert results["settings"]["rows"] == [kind for kind in benchmark.KINDS if kind not in skipped]
    assert not list(out.glob(".benchmark.json.*"))  # written by renaming a whole file over it: no partial file left


@pytest.mark.fast
def test_predict_is_measured_last_in_one_process_and_under_torchrun_beside_the_training_ceiling(
    tiny_data, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "bench"
    fake_measurements(monkeypatch, out)
    commands = []

    def run_predict(args, name, script):
        commands.append(script)
        return {"img_per_sec": 300.0 if name == "predict-1" else 240.0, "run_seconds": 5.0}

    monkeypatch.setattr(script_rows, "run_predict", run_predict)
    monkeypatch.setattr(script_rows, "chosen", lambda args, name: Choice())  # auto's, faked
    benchmark.main(small_benchmark(tiny_data, out, "--rows", "model-only,predict"))
    rows = json.loads((out / "benchmark.json").read_text())["rows"]
    assert [row["kind"] for row in rows] == ["model-only"] * 2 + ["auto", "predict", "predict"]
    assert [(row["processes"], row["training_step_img_per_sec"]) for row in rows[-2:]] == [(1, 100.0), (2, 100.0)]
    assert commands[0][-1].endswith("predict.py") and commands[1][:2] == ["-m", "torch.distributed.run"]
    assert (
        "predict.py: 300.0 img/s in one process, 0.80x that with 2 processes; 3.0x the training step's model-only "
        "ceiling (100.0 img/s) (no target)"
    ) in capsys.readouterr().out


@pytest.mark.fast
def test_the_targets_of_rows_not_measured_say_so():
    auto = compute_peak.row("train_single_gpu.py, auto", "auto", 1, "float32, NCHW", dict(AUTO_FIGURES), 1e12, 1e9)
    lines = benchmark.against_targets([auto], native_bf16=False) + benchmark.auto_targets([auto])
    measured = [line for line in lines if not line.endswith(": not measured")]
    assert measured == ["auto's measuring took 4.0 s of its first run's 20 s (no target)"]
    assert len(lines) == 10  # every target, measured or not
    assert "| train_single_gpu.py, auto | 1 | float32, NCHW | 90.0 | – | 9% |" in benchmark.markdown_table([auto])


def timm_line(epoch: int, step: int, steps: int, rate: float) -> str:
    """A line of timm's train.py's log (its train_one_epoch's _logger.info), as it formats it."""
    return (
        f"INFO:train:Train: {epoch} [{step:>4d}/{steps} ({100.0 * (step + 1) / steps:>3.0f}%)]  Loss: 1.61 (1.62)  "
        f"Time: 0.500s,   32.00/s  ({16 / rate:.3f}s, {rate:>7.2f}/s)  LR: 1.000e-05  Data: 0.010 (0.020)"
    )


@pytest.mark.fast
def test_timms_rates_are_each_epochs_average_on_its_last_step():
    log = "\n".join([timm_line(0, 0, 7, 9.5), timm_line(0, 6, 7, 20.25), timm_line(1, 0, 7, 11.0)])
    log += "\n" + timm_line(1, 6, 7, 25.5) + "\nINFO:train:Test: [   0/2]  Time: 0.1 (0.1)"
    assert script_rows.timm_rates(log, 2) == [20.25, 25.5]
    with pytest.raises(UserError, match="logged no rate for some of its 3 epochs"):
        script_rows.timm_rates(log, 3)
