"""plot_results.py: training curves from run folders and the throughput chart from a benchmark.json, as PNGs."""

import json

import numpy as np
import pytest
from conftest import assert_user_error, run_script
from PIL import Image

from plot_results import main, plot_benchmark, plot_curves, plot_predictions, read_metrics, run_label


def write_run(folder, world_size: int, epochs: int = 4):
    """A run folder with a metrics.jsonl as run_log.py writes it (the fields the plots read, and some they do not)."""
    folder.mkdir(parents=True)
    lines = [
        {"epoch": e, "train_loss": 2.0 / (e + 1), "val_acc": 0.2 + 0.15 * e, "lr": 0.01 * world_size / (e + 1),
         "epoch_seconds": 9.5, "train_images_per_sec": 60.0 / world_size, "world_size": world_size}
        for e in range(epochs)
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


BENCHMARK = {
    "machine": "Intel Xeon (2 cores), no GPU",
    "date": "2026-11-22",
    "torch": "2.14.1",
    "settings": {"img_size": 224, "batch_size": 16, "nprocs": 2, "device": "cpu", "precision": "bf16",
                 "channels_last": True, "train_images": 800},
    "rows": [
        {"name": "model only (ceiling)", "kind": "model-only", "processes": 1, "img_per_sec": 29.4,
         "epoch_seconds": None, "peak_rss_mib": 1450},
        {"name": "baseline: original setup (fp32, NCHW, workers restarted each epoch)", "kind": "baseline",
         "processes": 1, "img_per_sec": 9.8, "epoch_seconds": 81.2, "peak_rss_mib": 1300},
        {"name": "torchrun, 2 processes", "kind": "torchrun", "processes": 2, "img_per_sec": 17.3,
         "epoch_seconds": 46.1, "peak_rss_mib": 2600},
    ],
}  # fmt: skip


def assert_png(path):
    """A real picture, large enough to read at README width."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 600 and image.height >= 300, image.size
    assert path.stat().st_size > 10_000


def legend_texts(fig) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def test_two_runs_are_drawn_into_one_png(tmp_path):
    a, b = write_run(tmp_path / "single", 1), write_run(tmp_path / "ddp", 2)
    result = run_script("plot_results.py", a, b, "--output", tmp_path / "curves.png")
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "curves.png")
    assert not (a / "training_curves.png").exists() and not (b / "training_curves.png").exists()


@pytest.mark.fast
def test_overlaid_runs_are_named_in_the_legend_with_their_number_of_processes(tmp_path):
    a, b = write_run(tmp_path / "single", 1), write_run(tmp_path / "ddp", 2, epochs=3)
    runs = [(run_label(folder, read_metrics(folder / "metrics.jsonl")), read_metrics(folder / "metrics.jsonl"))
            for folder in (a, b)]  # fmt: skip
    fig = plot_curves(runs)
    assert legend_texts(fig) == ["single (1 process)", "ddp (2 processes)"]
    assert [ax.get_title() for ax in fig.axes] == ["training loss", "validation accuracy", "learning rate"]
    loss_lines = fig.axes[0].get_lines()
    assert [list(line.get_xdata()) for line in loss_lines] == [[0, 1, 2, 3], [0, 1, 2]]
    assert list(fig.axes[2].get_lines()[1].get_ydata()) == [0.02, 0.01, 0.02 / 3]


@pytest.mark.fast
def test_labels_flag_names_the_runs_in_the_legend(tmp_path):
    a, b = write_run(tmp_path / "a", 1), write_run(tmp_path / "b", 2)
    fig = main([str(a), str(b), "--labels", "one", "two", "--output", str(tmp_path / "c.png")])
    assert legend_texts(fig) == ["one", "two"]
    assert_png(tmp_path / "c.png")


def test_one_run_is_drawn_into_its_own_folder_by_default(tmp_path):
    run = write_run(tmp_path / "run", 1)
    result = run_script("plot_results.py", run, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_png(run / "training_curves.png")


def test_a_benchmark_json_gives_the_throughput_chart_next_to_it(tmp_path):
    (tmp_path / "benchmark.json").write_text(json.dumps(BENCHMARK))
    result = run_script("plot_results.py", tmp_path, cwd=tmp_path)  # a folder holding benchmark.json works too
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "benchmark.png")


@pytest.mark.fast
def test_the_benchmark_chart_labels_each_bar_and_says_where_it_was_measured(tmp_path):
    fig = plot_benchmark(BENCHMARK, tmp_path / "benchmark.png")
    assert_png(tmp_path / "benchmark.png")
    ax = fig.axes[0]
    assert [bar.get_width() for bar in ax.patches] == [29.4, 9.8, 17.3]
    assert [text.get_text() for text in ax.texts] == ["29.4", "9.8", "17.3"]
    assert [label.get_text().replace("\n", " ") for label in ax.get_yticklabels()] == [
        row["name"] for row in BENCHMARK["rows"]
    ]
    for fragment in ("Intel Xeon (2 cores), no GPU", "2026-11-22", "224 px", "batch 16", "bf16"):
        assert fragment in ax.get_title()


@pytest.mark.fast
def test_the_loader_demo_and_predict_rows_have_a_panel_of_their_own_below_the_training_rows(tmp_path):
    apart = [
        {"name": "loader, 1 worker", "kind": "loader", "processes": 1, "img_per_sec": 861.1},
        {"name": "demo", "kind": "demo", "processes": 1, "img_per_sec": 156.7},
    ]
    scored = {"name": "predict.py, 1 process", "kind": "predict", "processes": 1, "img_per_sec": 97.5}
    fig = plot_benchmark({**BENCHMARK, "rows": [*BENCHMARK["rows"][:2], *apart, BENCHMARK["rows"][2], scored]})
    top, below = fig.axes
    assert [bar.get_width() for bar in top.patches] == [29.4, 9.8, 17.3]  # the training rows, in their order
    assert [bar.get_width() for bar in below.patches] == [861.1, 156.7, 97.5]
    assert top.get_xlim()[1] < 40 and "Intel Xeon" in top.get_title()


@pytest.mark.fast
def test_each_preview_image_is_labelled_with_its_prediction_green_when_right_red_with_the_truth_when_wrong():
    images = [np.full((32, 32, 3), shade) for shade in np.linspace(0, 1, 6)]
    fig = plot_predictions(images, [0, 1, 2, 0, 1, 2], [0, 1, 1, 0, 2, 2], ["daisy", "roses", "tulips"])
    labels = [(text.get_text(), text.get_color()) for text in fig.axes[0].texts]
    assert labels == [
        ("daisy", "green"), ("roses", "green"), ("roses\n(true: tulips)", "red"),
        ("daisy", "green"), ("tulips\n(true: roses)", "red"), ("tulips", "green"),
    ]  # fmt: skip
    # every label sits above its own picture: left to right, then the next row lower down
    positions = [text.get_position() for text in fig.axes[0].texts]
    assert positions[0][0] < positions[1][0] < positions[2][0] < positions[3][0] and positions[4][1] > positions[0][1]


def test_the_curves_of_a_real_training_run(trained_run, tmp_path):
    out, _ = trained_run
    result = run_script("plot_results.py", out, "--output", tmp_path / "curves.png")
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "curves.png")
    epochs = read_metrics(out / "metrics.jsonl")
    assert [record["epoch"] for record in epochs] == list(range(6))
    assert run_label(out, epochs) == f"{out.name} (1 process)"


ONE_EPOCH = '{"epoch": 0, "train_loss": 1.5, "val_acc": 0.5, "lr": 0.1}'


@pytest.mark.parametrize(
    "files, argument, fragment",
    [
        ({}, "nowhere", "nowhere does not exist"),
        ({"folder/notes.txt": "hello"}, "folder", "neither a run folder (with metrics.jsonl) nor a benchmark.json"),
        ({"run/metrics.jsonl": ""}, "run", "metrics.jsonl holds no epochs"),
        ({"run/metrics.jsonl": ONE_EPOCH + '\n{"epoch": 1, "train_'}, "run", "metrics.jsonl line 2 is not JSON"),
        ({"run/metrics.jsonl": '{"epoch": 0, "val_acc": 0.5}'}, "run", "line 1 has no number for train_loss, lr"),
        ({"b/benchmark.json": '{"rows": []}'}, "b", "benchmark.json has no benchmark rows"),
        ({"b/benchmark.json": '{"rows": [{"name": "x", "img_per_sec": "fast"}]}'}, "b", "img_per_sec 'fast'"),
    ],
    ids=["missing", "no-metrics", "empty", "malformed", "missing-keys", "no-rows", "not-a-number"],
)
@pytest.mark.fast
def test_unusable_inputs_are_one_line_and_exit_2_and_overwrite_nothing(tmp_path, run_main, files, argument, fragment):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    existing = tmp_path / "precious.png"
    existing.write_bytes(b"not ours")
    result = run_main("plot_results.py", tmp_path / argument, "--output", existing)
    assert_user_error(result, fragment)
    assert existing.read_bytes() == b"not ours"


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--output", "no_such_folder/curves.png"], "the folder no_such_folder does not exist"),
        (["--output", "metrics.jsonl"], "must end in .png"),
        (["--labels", "only-one", "too-many"], "--labels gives 2 name(s) for 1 run folder(s)"),
    ],
)
@pytest.mark.fast
def test_bad_output_or_labels_are_one_line_and_exit_2(tmp_path, monkeypatch, run_main, flags, fragment):
    run = write_run(tmp_path / "run", 1)
    before = (run / "metrics.jsonl").read_text()
    monkeypatch.chdir(run)  # --output's relative paths from the run folder, as from a shell there
    assert_user_error(run_main("plot_results.py", run, *flags), fragment)
    assert (run / "metrics.jsonl").read_text() == before
    assert not (run / "training_curves.png").exists()
