"""predict.py and evaluate.py on every process (torchrun, spawn) as in one: each image once, in the order of the
images, scored as one process scores it, an unreadable one reported in its row; their results file, written
whole or not at all."""

import json
import os
import signal

import pytest
import torch
from conftest import assert_user_error, run_script, torchrun
from torchvision.models import resnet18

import evaluate
import predict
from inference.results import Row, read_results, results_file
from inference.scoring import log_probabilities, scored_batches
from inference.trained import TrainedModel
from multi_train_utils.train_eval_utils import Choice

TOLERANCE = 1e-5  # float32: a batch of other images, or another size, may round differently in the last bits


@pytest.fixture(scope="module")
def images(tiny_data, tmp_path_factory):
    """tiny_data's 60 images (links to them) and one broken JPEG among the roses: 61, which neither 2 nor 3
    divides, in 8 batches of the run's 8."""
    folder = tmp_path_factory.mktemp("scoring") / "data"
    for image in sorted(tiny_data.rglob("*.jpg")):
        (folder / image.parent.name).mkdir(parents=True, exist_ok=True)
        (folder / image.parent.name / image.name).symlink_to(image)
    (folder / "roses" / "roses_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 half a JPEG")
    return folder


@pytest.fixture(scope="module")
def weights(torchrun_run):
    """The last weights of the suite's torchrun run: MobileNetV3-Small at 32 px, batch 8, float32 NCHW (--amp off)."""
    return torchrun_run[1] / "weights" / "last.pth"


def predict_flags(images, weights, results) -> list:
    return [images, "--weights", weights, "--topk", "5", "--results", results]


def evaluate_flags(images, weights, results, output_dir) -> list:
    """--all: every image of the folder, the broken one included (a split would leave it out first)."""
    return ["--weights", weights, "--data-path", images, "--all", "--topk", "5", "--results", results,
            "--output-dir", output_dir]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(images, weights, tmp_path_factory):
    """The results of predict.py and evaluate.py in one process (in this one: no interpreter to start), and
    evaluate.py's eval.json."""
    out = tmp_path_factory.mktemp("one_process")
    predict.main([str(flag) for flag in predict_flags(images, weights, out / "predict.csv")])
    evaluate.main([str(flag) for flag in evaluate_flags(images, weights, out / "evaluate.jsonl", out / "eval")])
    report = json.loads((out / "eval" / "eval.json").read_text())
    return {"predict": read_results(out / "predict.csv"), "evaluate": read_results(out / "evaluate.jsonl")}, report


def test_one_process_gives_every_image_one_row_in_order_the_broken_one_saying_why(images, one_process):
    rows, report = one_process
    expected = [str(images / name.parent.name / name.name) for name in sorted(images.rglob("*.jpg"))]
    assert [row["path"] for row in rows["predict"]] == expected  # folder by folder, file by file
    assert sorted(row["path"] for row in rows["evaluate"]) == sorted(expected)  # the split's order: train, val
    for tool, tool_rows in rows.items():
        broken = [row for row in tool_rows if row["unreadable"]]
        assert [row["path"] for row in broken] == [str(images / "roses" / "roses_broken.jpg")], tool
        assert "Truncated" in broken[0]["unreadable"] and broken[0]["classes"] == []
        for row in tool_rows:
            if not row["unreadable"]:
                assert len(row["classes"]) == 5 and sum(row["probabilities"]) == pytest.approx(1, abs=1e-5)
                assert row["probabilities"] == sorted(row["probabilities"], reverse=True)
    assert all(row["true_class"] is None for row in rows["predict"])  # unknown to predict.py
    assert all(row["true_class"] == row["path"].split(os.sep)[-2] for row in rows["evaluate"])
    assert report["total"] == 60 and sum(map(sum, report["confusion_matrix"])) == 60  # the broken one: in none


# Each tool under each launcher, and each launcher at world sizes 2 and 3 (3 divides neither the images nor a
# batch, so the shards differ and the last batches are uneven): one launch each, every check at once.
LAUNCHES = {
    "predict, torchrun, 3 processes": ("predict.py", torchrun(3), (), "csv"),
    "predict, spawn, 2 processes": ("predict.py", (), ("--world-size", "2"), "jsonl"),
    "evaluate, torchrun, 2 processes": ("evaluate.py", torchrun(2), (), "jsonl"),
    "evaluate, spawn, 3 processes": ("evaluate.py", (), ("--world-size", "3"), "csv"),
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_every_process_together_write_the_rows_of_one_process(launch, images, weights, one_process, tmp_path):
    script, launcher, spawn, form = LAUNCHES[launch]
    results = tmp_path / f"results.{form}"
    if script == "predict.py":
        flags = predict_flags(images, weights, results)
    else:
        flags = evaluate_flags(images, weights, results, tmp_path / "eval")
    result = run_script(script, *flags, *spawn, launcher=launcher, timeout=180)
    assert result.returncode == 0, result.stderr

    rows, expected = read_results(results), one_process[0][script.removesuffix(".py")]
    assert [row["path"] for row in rows] == [row["path"] for row in expected]  # each image once, in order
    for row, alone in zip(rows, expected, strict=True):
        assert (row["true_class"], row["unreadable"]) == (alone["true_class"], alone["unreadable"])
        scored = dict(zip(row["classes"], row["probabilities"], strict=True))
        assert scored == pytest.approx(dict(zip(alone["classes"], alone["probabilities"], strict=True)), abs=TOLERANCE)
    if script == "evaluate.py":
        report = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert report["confusion_matrix"] == one_process[1]["confusion_matrix"]
        assert (report["correct"], report["total"]) == (one_process[1]["correct"], 60)
    assert result.stderr.count("warning: skipped unreadable image") == 1  # by the process whose shard it was


def test_a_run_stopped_while_predicting_leaves_no_results_file(images, weights, tmp_path, monkeypatch):
    def stopped_at_the_third_batch(*args, **options):
        for step, batch in enumerate(scored_batches(*args, **options)):
            if step == 2:  # the rows of the first two are in the temporary file by now
                os.kill(os.getpid(), signal.SIGTERM)  # as SLURM or torchrun would stop it
            yield batch

    monkeypatch.setattr(predict, "scored_batches", stopped_at_the_third_batch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:  # in this process: its handler is predict.py's while it scores
        predict.main([str(flag) for flag in predict_flags(images, weights, out / "rows.csv")])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert list(out.iterdir()) == []  # neither the results file nor its temporary file


@pytest.mark.fast
@pytest.mark.parametrize("name", ["rows.txt", "rows"])
def test_a_results_file_not_named_csv_or_jsonl_is_refused_in_one_line(tmp_path, run_main, name):
    result = run_main("predict.py", tmp_path, "--weights", tmp_path / "best.pth", "--results", tmp_path / name)
    assert_user_error(result, "name a .csv or a .jsonl file")


@pytest.mark.fast
@pytest.mark.parametrize("script", ["predict.py", "evaluate.py"])
def test_an_existing_results_file_is_kept_unless_force_is_given(tmp_path, run_main, script):
    (tmp_path / "rows.csv").write_text("kept\n")
    images = [tmp_path] if script == "predict.py" else []
    (tmp_path / "a.jpg").touch()  # predict.py checks the images exist before the results file; not their content
    result = run_main(script, *images, "--weights", tmp_path / "best.pth", "--results", tmp_path / "rows.csv")
    assert_user_error(result, f"{tmp_path / 'rows.csv'} exists: name another --results, or pass --force")
    assert (tmp_path / "rows.csv").read_text() == "kept\n"


@pytest.mark.fast
def test_world_size_under_torchrun_is_refused(tmp_path, run_main, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "a.jpg").touch()
    result = run_main("predict.py", tmp_path, "--weights", tmp_path / "best.pth", "--world-size", "2")
    assert_user_error(result, "under torchrun, --nproc_per_node says how many")


@pytest.mark.fast
def test_csv_and_jsonl_hold_the_same_rows(tmp_path):
    rows = [
        Row("a/daisy 1.jpg", "daisy", [("daisy", 0.91234567), ("roses", 0.08)]),
        Row("b,é.jpg", None, [("roses", 0.5), ("daisy", 0.5)]),
        Row("c.jpg", "tulips", [], unreadable="OSError: Truncated File Read"),
    ]
    for form in ("csv", "jsonl"):
        with results_file(tmp_path / f"rows.{form}", topk=2) as results:
            results.write(rows)
        read = read_results(tmp_path / f"rows.{form}")
        assert [(row["path"], row["true_class"], row["unreadable"]) for row in read] == [
            ("a/daisy 1.jpg", "daisy", None), ("b,é.jpg", None, None), ("c.jpg", "tulips", rows[2].unreadable)
        ]  # fmt: skip
        assert [row["classes"] for row in read] == [["daisy", "roses"], ["roses", "daisy"], []]
        assert read[0]["probabilities"] == [0.912346, 0.08]  # 6 decimals
    header = (tmp_path / "rows.csv").read_text(encoding="utf-8").splitlines()[0]
    assert header == "path,true_class,class_1,probability_1,class_2,probability_2,unreadable"


@pytest.mark.fast
def test_a_results_file_whose_writing_fails_midway_is_not_there(tmp_path):
    with pytest.raises(RuntimeError), results_file(tmp_path / "rows.jsonl", topk=1) as results:
        results.write([Row("a.jpg", None, [("daisy", 1.0)])])
        raise RuntimeError("a process of the job failed")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary file


@pytest.mark.fast
def test_tta_averages_the_probabilities_of_each_image_and_its_mirror_image():
    torch.manual_seed(0)
    model = resnet18(num_classes=5).eval()
    trained = TrainedModel(model, torch.device("cpu"), Choice(), list("abcde"), None, None)
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    with torch.inference_mode():
        plain = log_probabilities(trained, images, tta=False).exp()
        mirrored = log_probabilities(trained, images.flip(-1), tta=False).exp()
        averaged = log_probabilities(trained, images, tta=True).exp()
    assert not torch.allclose(plain, mirrored)  # the mirror image is scored otherwise: there is something to average
    torch.testing.assert_close(averaged, (plain + mirrored) / 2)


@pytest.mark.fast
@pytest.mark.parametrize(
    "script, flag", [("predict.py", "--results"), ("evaluate.py", "--results"), ("export.py", "--output")]
)
def test_no_results_or_export_replaces_a_file_of_a_run_even_with_force(tmp_path, run_main, script, flag):
    (tmp_path / "args.json").write_text("{}")  # tmp_path holds a run: its record may not be replaced by another command
    (tmp_path / "a.jpg").touch()
    weights = ["--weights", tmp_path / "best.pth"]
    given = {"predict.py": [tmp_path, *weights], "evaluate.py": weights, "export.py": [tmp_path / "best.pth"]}[script]
    records = ["metrics.jsonl"] + (["weights/last.pth", "checkpoint.pth"] if script == "export.py" else [])
    for record in records:
        target = tmp_path / record
        result = run_main(script, *given, flag, target, "--force", *["--format", "onnx"] * (script == "export.py"))
        assert_user_error(
            result, f"{flag} {target} is a file of the run in {tmp_path}, which no other command replaces"
        )
        assert not target.exists()
