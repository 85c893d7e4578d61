"""tools/benchmark.py end to end at toy sizes: every row measured, the files written, the table and targets printed."""

import json
import math

from conftest import run_script
from PIL import Image


def test_a_small_benchmark_measures_every_single_process_row_and_writes_its_files(tiny_data, tmp_path, run_main):
    out = tmp_path / "bench"
    result = run_script(
        "tools/benchmark.py",
        *("--data-path", tiny_data, "--output-dir", out, "--img-size", "32", "--batch-size", "8"),
        *("--epochs", "2", "--steps", "1", "--loader-images", "16", "--device", "cpu", "--skip-ddp", "--skip-demo"),
        *("--fixed", "float32-nchw"),  # one fixed configuration beside auto (each is a run of the script)
    )
    assert result.returncode == 0, result.stderr
    benchmark = json.loads((out / "benchmark.json").read_text())
    rows = benchmark["rows"]
    kinds = ["model-only"] * 3 + ["loop", "loader", "loader", "baseline", "fixed", "single"]
    assert [row["kind"] for row in rows] == kinds
    for row in rows:
        assert math.isfinite(row["img_per_sec"]) and row["img_per_sec"] > 0 and row["peak_rss_mib"] > 100
        if row["kind"] == "loader":  # loads images, trains nothing: no FLOPs
            assert row["peak_fraction"] is None
        else:
            assert 0 < row["peak_fraction"] < 1  # of the measured matrix-product peak of its precision
    # the ceiling alone runs without a host synchronisation in its loop; the other loops read each step's loss
    assert [row["host_sync_each_step"] for row in rows[:4]] == [False, True, False, True]
    # one worker, then the training scripts' count on this machine as auto chose it (at least one)
    scripts = benchmark["settings"]["workers"]
    assert [row["workers"] for row in rows[4:6]] == [1, max(1, scripts)]
    assert rows[4]["img_per_sec_per_worker"] == rows[4]["img_per_sec"]
    baseline, fixed, single = rows[-3:]
    assert baseline["precision"] == fixed["precision"] == "float32, NCHW" and single["epoch_seconds"] > 0
    # auto measured in its run, in the benchmark's own cache; the rows without a script computed as it chose
    assert single["measure_seconds"] > 0 and (out / "autotune.json").exists()
    assert rows[0]["precision"] == single["precision"] == benchmark["settings"]["precision"]
    # each training row is a real run of the script, with its own metrics; the baseline restarts its loader
    # workers every epoch, as the original did (--no-persistent-workers)
    for name in ("auto", "baseline", "fixed-float32-nchw"):
        assert len((out / "runs" / name / "metrics.jsonl").read_text().splitlines()) == 2
    assert "2 loader workers per process" in (out / "logs" / "baseline.log").read_text()
    # the machine the figures hold for: processor, cores, the instruction set torch computes with, the peaks
    settings = benchmark["settings"]
    assert "cores, torch kernels" in benchmark["machine"] and settings["matmul_peak_flops"]["float32"] > 1e9
    assert 1e6 < settings["training_flops_per_image"] < 1e10  # ResNet-34 at 32 px: about 0.2 GFLOP
    assert "| train_single_gpu.py, auto | 1 |" in result.stdout and "Matrix-product peak: float32" in result.stdout
    assert "auto against the original's configuration (float32, NCHW): " in result.stdout
    assert "against the best fixed configuration (float32, NCHW): " in result.stdout
    assert "of the model-only ceiling" in result.stdout and "x the original's setup" in result.stdout
    assert "| loader, 1 worker | 1 | – |" in result.stdout and f"loader with {max(1, scripts)} worker" in result.stdout
    assert "loss.item() each step costs" in result.stdout
    with Image.open(out / "benchmark.png") as png:
        assert png.format == "PNG" and png.width >= 600
    rerun = run_main("tools/benchmark.py", "--data-path", tiny_data, "--output-dir", out, "--skip-ddp")
    assert rerun.returncode == 2 and "already holds a benchmark" in rerun.stderr  # never overwrites
