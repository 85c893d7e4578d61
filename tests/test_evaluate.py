"""evaluate.py: a run's weights on the split the run validated on, its scores, eval.json and the confusion matrix."""

import json
import re

import pytest
import torch
from conftest import assert_user_error, run_script
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, TensorDataset

import evaluate
from dataset.demo import make_demo_data
from dataset.folders import list_images, read_split_data, write_class_indices
from dataset.images import SKIPPED
from dataset.transforms import normalise, val_transform
from multi_train_utils.train_eval_utils import evaluate as evaluate_loop
from my_dataset import MyDataSet
from network.architectures import create_model
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
        precision_and_recall = scores["precision"] + scores["recall"]
        f1 = 2 * scores["precision"] * scores["recall"] / precision_and_recall if precision_and_recall else 0.0
        assert scores["f1"] == pytest.approx(f1)


def test_with_five_classes_there_is_no_top5_accuracy(last_epoch_evaluation):
    stdout, report, _ = last_epoch_evaluation
    assert len(report["classes"]) == 5
    assert report["top5_accuracy"] is None and report["top5_correct"] is None  # it would always be 1
    assert "top-5" not in stdout


def test_the_table_shows_each_class_precision_recall_f1_and_support(last_epoch_evaluation):
    stdout, report, _ = last_epoch_evaluation
    assert re.search(r"^class\s+precision\s+recall\s+f1\s+support$", stdout, re.MULTILINE)
    for name, s in report["per_class"].items():
        row = rf"^{name}\s+{s['precision']:.3f}\s+{s['recall']:.3f}\s+{s['f1']:.3f}\s+{s['support']}$"
        assert re.search(row, stdout, re.MULTILINE), (row, stdout)


def test_the_confusion_matrix_is_a_png_picture(last_epoch_evaluation):
    path = last_epoch_evaluation[2] / "confusion_matrix.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 300 and image.height >= 300
        image.load()  # decodes: the whole file is there
    assert path.stat().st_size > 10_000


@pytest.mark.fast
def test_precision_of_a_class_never_predicted_is_zero():
    confusion = torch.tensor([[2, 0, 0], [1, 0, 0], [0, 0, 3]])  # class 1 is never predicted
    scores = evaluate.per_class_scores(confusion)
    assert scores == {
        "precision": [2 / 3, 0.0, 1.0],
        "recall": [1.0, 0.0, 1.0],
        "f1": [0.8, 0.0, 1.0],  # 2 (2/3) 1 / (2/3 + 1) = 0.8
        "support": [2, 1, 3],
    }


@pytest.mark.fast
def test_f1_is_2pr_over_p_plus_r_and_zero_where_p_plus_r_is_zero():
    confusion = torch.tensor([[3, 1, 0, 0], [2, 0, 2, 0], [0, 0, 4, 0], [0, 0, 0, 0]])  # rows: true class
    scores = evaluate.per_class_scores(confusion)
    assert scores["precision"] == pytest.approx([3 / 5, 0.0, 4 / 6, 0.0])
    assert scores["recall"] == pytest.approx([3 / 4, 0.0, 4 / 4, 0.0])
    # class 0: 2 (3/5)(3/4) / (3/5 + 3/4) = 0.9 / 1.35; class 1 predicted once, never right; class 2:
    # 2 (2/3) 1 / (2/3 + 1); class 3 has no images and is never predicted
    assert scores["f1"] == pytest.approx([0.9 / 1.35, 0.0, 0.8, 0.0])


class LogitsOf(torch.nn.Module):
    """A "network" whose input is an index into fixed logits: evaluate() on logits chosen by hand."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, index):
        return self.logits[index]


@pytest.mark.fast
def test_topk_counts_the_images_whose_true_class_is_among_their_k_highest_logits():
    falling, rising = torch.arange(7.0, 0.0, -1.0), torch.arange(1.0, 8.0)
    logits = torch.stack([falling, falling, falling, rising, rising])
    # true class ranks 1st, 5th, 6th and 2nd by logit; the last image could not be read: it counts nowhere
    labels = torch.tensor([0, 4, 5, 5, SKIPPED])
    loader = DataLoader(TensorDataset(torch.arange(5), labels), batch_size=2)
    confusion, in_top5 = evaluate_loop(LogitsOf(logits), loader, "cpu", 7, topk=5)
    assert in_top5 == 3
    assert confusion.sum() == 4 and confusion[0, 0] == 1 and confusion[4, 0] == confusion[5, 0] == confusion[5, 6] == 1
    assert evaluate_loop(LogitsOf(logits), loader, "cpu", 7, topk=1)[1] == int(confusion.trace()) == 1
    assert torch.equal(evaluate_loop(LogitsOf(logits), loader, "cpu", 7), confusion)  # no topk: the matrix alone


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
    # In this process: evaluate.py's command line as a user runs it is last_epoch_evaluation's.
    evaluate.main.__wrapped__(["--weights", str(run_copy / "weights" / "best.pth"), "--data-path", str(data), "--all"])
    report = json.loads((run_copy / "eval" / "eval.json").read_text())  # default --output-dir: RUN/eval
    assert report["total"] == 15 and report["split"] == {"images": "all", "data_path": str(data)}
    assert (run_copy / "eval" / "confusion_matrix.png").is_file()


def test_data_with_other_classes_is_refused_and_nothing_is_written(learnable_data, run_copy, tmp_path, run_main):
    data = tmp_path / "four_classes"
    data.mkdir()
    for class_folder in sorted(learnable_data.iterdir())[:4]:
        (data / class_folder.name).symlink_to(class_folder)
    result = run_main("evaluate.py", "--weights", run_copy / "weights" / "best.pth", "--data-path", data)
    assert_user_error(result, "was trained on classes ['daisy', 'dandelion', 'roses', 'sunflowers', 'tulips']")
    assert not (run_copy / "eval").exists()


def test_without_the_runs_flags_the_data_path_must_be_given(trained_run, tmp_path):
    (tmp_path / "best.pth").symlink_to(trained_run[0] / "weights" / "best.pth")
    argv = ["--weights", tmp_path / "best.pth", "--class-indices", trained_run[0] / "class_indices.json"]
    argv += ["--model", "resnet18"]  # the run's network (SMALL_MODEL), which a weights file alone does not say
    with pytest.raises(UserError, match="no data: give --data-path"):
        evaluate.main.__wrapped__(list(map(str, argv)))  # in this process: no interpreter start-up


def test_a_run_whose_data_folder_is_gone_asks_for_data_path(run_copy, tmp_path):
    run_args = json.loads((run_copy / "args.json").read_text())
    (run_copy / "args.json").unlink()
    (run_copy / "args.json").write_text(json.dumps({**run_args, "data_path": str(tmp_path / "moved")}))
    expected = f"the run's data path {tmp_path / 'moved'} is not a folder here: give --data-path"
    with pytest.raises(UserError, match=re.escape(expected)):
        evaluate.main.__wrapped__(["--weights", str(run_copy / "weights" / "best.pth")])


@pytest.fixture(scope="module")
def six_classes(tmp_path_factory):
    """6 classes x 10 JPEGs (the demo's five, and mirrored daisies as a sixth), a ResNet-34 for them as seeded, and
    its class_indices.json: a model with top-5 accuracy to report."""
    folder = tmp_path_factory.mktemp("six_classes")
    data = make_demo_data(folder / "data", images_per_class=10, size=(40, 40))
    (data / "zinnias").mkdir()
    for image in list_images(data / "daisy"):
        with Image.open(image) as daisy:
            ImageOps.mirror(daisy).save(data / "zinnias" / image.name.replace("daisy", "zinnia"))
    torch.manual_seed(0)
    torch.save(create_model(6).state_dict(), folder / "six.pth")
    write_class_indices(sorted(p.name for p in data.iterdir()), folder)
    return data, folder / "six.pth", folder / "class_indices.json"


def test_with_six_classes_eval_json_has_the_top5_accuracy_of_the_networks_logits(six_classes, tmp_path, capsys):
    data, weights, class_indices = six_classes
    flags = ["--class-indices", class_indices, "--data-path", data, "--img-size", "32", "--batch-size", "4"]
    argv = ["--weights", weights, *flags, "--workers", "0", "--output-dir", tmp_path]
    evaluate.main.__wrapped__([str(arg) for arg in argv])  # in this process, as test_all_... runs it
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "eval.json").read_text())

    split = read_split_data(data, 0.2, 0)  # the defaults, as evaluate.py splits without the run's flags
    model = create_model(6)
    model.load_state_dict(torch.load(weights, weights_only=True))
    loader = DataLoader(MyDataSet(split.val_images, split.val_labels, val_transform(32)), batch_size=4)
    with torch.no_grad():
        logits, labels = zip(*((model.eval()(normalise(images)), labels) for images, labels in loader), strict=True)
    logits, labels = torch.cat(logits), torch.cat(labels)
    in_top5 = int((logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1).sum())
    assert report["total"] == len(labels) == 12 and report["correct"] == int((logits.argmax(dim=1) == labels).sum())
    assert report["top5_correct"] == in_top5 and report["top5_accuracy"] == in_top5 / 12
    assert f"top-5 accuracy {in_top5 / 12:.3f} ({in_top5}/12)" in printed, printed
    assert set(report["per_class"]["zinnias"]) == {"precision", "recall", "f1", "support"}
