"""evaluate.py: a run's weights on the split the run validated on, its scores, eval.json and the confusion matrix."""

import json
import re

import pytest
import torch
from conftest import assert_user_error, run_script
from PIL import Image

import evaluate
from my_dataset import list_images
from utils import UserError


@pytest.fixture(scope="module")
def last_metrics(trained_run) -> dict:
    return json.loads((trained_run[0] / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def last_epoch_evaluation(trained_run, last_metrics, tmp_path_factory):
    """evaluate.py on the last epoch's weights, every flag but --output-dir left to the run's: (stdout, eval.json,
    output folder)."""
    output_dir = tmp_path_factory.mktemp("evaluation") / "eval"
    weights = trained_run[0] / "weights" / "last.pth"
    result = run_script("evaluate.py", "--weights", weights, "--output-dir", output_dir)
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads((output_dir / "eval.json").read_text()), output_dir


def test_the_last_weights_score_exactly_what_their_epoch_logged(trained_run, last_metrics, last_epoch_evaluation):
    stdout, report, _ = last_epoch_evaluation
    confusion = torch.tensor(report["confusion_matrix"])
    assert (report["correct"], report["total"]) == (last_metrics["val_correct"], last_metrics["val_total"])
    assert confusion.diagonal().tolist() == last_metrics["val_per_class_correct"]
    assert confusion.sum(dim=1).tolist() == last_metrics["val_per_class_total"]
    correct, total = last_metrics["val_correct"], last_metrics["val_total"]
    assert f"accuracy {correct / total:.3f} ({correct}/{total})" in stdout
    run_args = json.loads((trained_run[0] / "args.json").read_text())
    assert report["split"] == {"images": "validation", **{k: run_args[k] for k in ("data_path", "val_rate", "seed")}}
    assert report["img_size"] == run_args["img_size"]


def test_eval_json_scores_follow_from_its_confusion_matrix(last_epoch_evaluation):
    report = last_epoch_evaluation[1]
    confusion = report["confusion_matrix"]  # rows: true class, columns: predicted
    assert report["accuracy"] == pytest.approx(sum(confusion[c][c] for c in range(5)) / sum(map(sum, confusion)))
    for c, name in enumerate(report["classes"]):
        predicted = sum(row[c] for row in confusion)
        scores = report["per_class"][name]
        assert scores["support"] == sum(confusion[c])
        assert scores["recall"] == pytest.approx(confusion[c][c] / sum(confusion[c]))
        assert scores["precision"] == pytest.approx(confusion[c][c] / predicted if predicted else 0.0)


def test_the_table_shows_each_class_precision_recall_and_support(last_epoch_evaluation):
    stdout, report, _ = last_epoch_evaluation
    assert re.search(r"^class\s+precision\s+recall\s+support$", stdout, re.MULTILINE)
    for name, scores in report["per_class"].items():
        row = rf"^{name}\s+{scores['precision']:.3f}\s+{scores['recall']:.3f}\s+{scores['support']}$"
        assert re.search(row, stdout, re.MULTILINE), (row, stdout)


def test_the_confusion_matrix_is_a_png_picture(last_epoch_evaluation):
    path = last_epoch_evaluation[2] / "confusion_matrix.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 300 and image.height >= 300
        image.load()  # decodes: the whole file is there
    assert path.stat().st_size > 10_000


def test_precision_of_a_class_never_predicted_is_zero():
    confusion = torch.tensor([[2, 0, 0], [1, 0, 0], [0, 0, 3]])  # class 1 is never predicted
    scores = evaluate.per_class_scores(confusion)
    assert scores == {"precision": [2 / 3, 0.0, 1.0], "recall": [1.0, 0.0, 1.0], "support": [2, 1, 3]}


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A run folder of links to the trained run's files (so evaluating it writes nothing into the shared run)."""
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    for name in ("args.json", "class_indices.json", "weights/best.pth"):
        (run / name).symlink_to(trained_run[0] / name)
    return run


def test_all_evaluates_every_image_of_the_data_folder_into_the_run_folder(learnable_data, run_copy, tmp_path):
    data = tmp_path / "data"
    for class_folder in sorted(learnable_data.iterdir()):
        (data / class_folder.name).mkdir(parents=True)
        for image in list_images(class_folder)[:3]:
            (data / class_folder.name / image.name).symlink_to(image)
    result = run_script("evaluate.py", "--weights", run_copy / "weights" / "best.pth", "--data-path", data, "--all")
    assert result.returncode == 0, result.stderr
    report = json.loads((run_copy / "eval" / "eval.json").read_text())  # default --output-dir: RUN/eval
    assert report["total"] == 15 and report["split"] == {"images": "all", "data_path": str(data)}
    assert (run_copy / "eval" / "confusion_matrix.png").is_file()


def test_data_with_other_classes_is_refused_and_nothing_is_written(learnable_data, run_copy, tmp_path):
    data = tmp_path / "four_classes"
    data.mkdir()
    for class_folder in sorted(learnable_data.iterdir())[:4]:
        (data / class_folder.name).symlink_to(class_folder)
    result = run_script("evaluate.py", "--weights", run_copy / "weights" / "best.pth", "--data-path", data)
    assert_user_error(result, "was trained on classes ['daisy', 'dandelion', 'roses', 'sunflowers', 'tulips']")
    assert not (run_copy / "eval").exists()


def test_without_the_runs_flags_the_data_path_must_be_given(trained_run, tmp_path):
    (tmp_path / "best.pth").symlink_to(trained_run[0] / "weights" / "best.pth")
    argv = ["--weights", tmp_path / "best.pth", "--class-indices", trained_run[0] / "class_indices.json"]
    with pytest.raises(UserError, match="no data: give --data-path"):
        evaluate.main.__wrapped__(list(map(str, argv)))  # in this process: no interpreter start-up


def test_a_run_whose_data_folder_is_gone_asks_for_data_path(run_copy, tmp_path):
    run_args = json.loads((run_copy / "args.json").read_text())
    (run_copy / "args.json").unlink()
    (run_copy / "args.json").write_text(json.dumps({**run_args, "data_path": str(tmp_path / "moved")}))
    expected = f"the run's data path {tmp_path / 'moved'} is not a folder here: give --data-path"
    with pytest.raises(UserError, match=re.escape(expected)):
        evaluate.main.__wrapped__(["--weights", str(run_copy / "weights" / "best.pth")])
