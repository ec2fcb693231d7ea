"""Tests of the analysis package: local separation and entropy against direct computations, the
figures, `analyse` on a tiny model, the callback (files, logged metrics, W&B images) and the command."""

import argparse
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import WandbLogger

import main_pretrain
from analysis import RepresentationAnalysis, analyse
from analysis.__main__ import main as analyse_checkpoint
from analysis import knn
from analysis.knn import knn_grid
from analysis.figures import plot_against_temperature, plot_local_separation, plot_negative_entropy
from analysis.key_distribution import key_distribution
from analysis.metrics import local_separation, negative_entropy, tolerance
from analysis.representation import eval_embeddings, fixed_subset
from datamodules.digits import composite_digits
from methods import NPID
from methods.evaluation import knn_predict, knn_topk_accuracy
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits
from test_supcon import CROPS, tiny_supcon

ROOT = Path(__file__).parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def unit(seed, *shape):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000, path
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_local_separation_is_the_positive_and_the_sorted_nearest_negatives():
    anchors, targets = unit(0, 6, 4), unit(1, 6, 4)
    positive, nearest = local_separation(anchors, targets, k=3)
    for i in range(6):
        assert positive[i].item() == pytest.approx((anchors[i] @ targets[i]).item(), abs=1e-12)
        others = sorted(((anchors[i] @ targets[j]).item() for j in range(6) if j != i), reverse=True)
        assert nearest[i].tolist() == pytest.approx(others[:3], abs=1e-12)


def test_negative_entropy_is_the_entropy_of_the_softmax_over_the_other_targets():
    anchors, targets, tau = unit(2, 5, 3), unit(3, 5, 3), 0.3
    entropy = negative_entropy(anchors, targets, tau)
    for i in range(5):
        weights = [math.exp((anchors[i] @ targets[j]).item() / tau) for j in range(5) if j != i]
        probabilities = [w / sum(weights) for w in weights]
        assert entropy[i].item() == pytest.approx(-sum(p * math.log(p) for p in probabilities), abs=1e-10)


def test_negative_entropy_grows_with_temperature_and_is_maximal_for_equal_similarities():
    anchors, targets = unit(4, 8, 5), unit(5, 8, 5)
    entropies = torch.stack([negative_entropy(anchors, targets, tau) for tau in (0.05, 0.1, 0.2, 0.5, 1.0)])
    assert (entropies.diff(dim=0) > 0).all()  # Wang & Liu supplementary, Sec. 2
    same = unit(6, 1, 5).expand(8, 5)
    torch.testing.assert_close(negative_entropy(same, same, 0.1), torch.full((8,), math.log(7), dtype=torch.float64))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: local_separation(unit(0, 4, 3), unit(1, 4, 3), k=4), r"k must lie in \[1, 3\]"),
        (lambda: local_separation(unit(0, 4, 3), unit(1, 5, 3)), r"targets must have the anchors' shape \(4, 3\)"),
        (lambda: negative_entropy(unit(0, 4, 3), unit(1, 4, 3), 0.0), "temperature must be > 0"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_figure_is_written_as_a_non_empty_png(tmp_path):
    positive, nearest = local_separation(unit(7, 20, 4), unit(8, 20, 4))
    assert_png(plot_local_separation(positive, nearest, tmp_path / "a" / "separation.png", "title"))
    assert_png(plot_negative_entropy(negative_entropy(unit(7, 20, 4), unit(8, 20, 4), 0.1), tmp_path / "entropy.png"))
    curves = {"ordinary": {0.1: {"acc": 0.5, "unif": 3.0}, 0.5: {"acc": 0.6, "unif": 2.0}}, "hard": {0.1: {"acc": 0.4, "unif": None}}}
    assert_png(plot_against_temperature(curves, {"acc": "accuracy", "unif": "-L_uniformity"}, tmp_path / "sweep.png"))


def tiny_npid() -> NPID:
    return NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.2, knn_k=0).train()


@pytest.mark.slow
def test_analyse_reports_a_fixed_subset_in_eval_mode_and_leaves_the_random_streams_alone():
    model, datamodule = tiny_npid(), digits({"image": {"preset": "npid"}}, batch_size=16)
    state, python_state = torch.random.get_rng_state(), random.getstate()
    report = analyse(model, datamodule, max_samples=40)
    assert torch.equal(torch.random.get_rng_state(), state) and random.getstate() == python_state and model.training
    assert report.positive.shape == (40,) and report.nearest_negatives.shape == (40, 10)
    assert (report.nearest_negatives.diff(dim=1) <= 0).all()
    again = analyse(model, datamodule, max_samples=40)  # the same images and augmentations
    assert report.scalars() == again.scalars()
    # in eval mode: a model put there first gives the same report (BatchNorm on batch statistics would not)
    assert analyse(model.eval(), datamodule, max_samples=40).scalars() == report.scalars()
    assert 0 < report.uniformity <= 4 and -1 <= report.tolerance <= 1
    assert 0 < report.scalars()["negative_entropy"] <= math.log(39)
    # the numbers of the report's own parts: the nearest negative, the targets' tolerance, the temperature given
    assert report.scalars()["local_separation"] == pytest.approx((report.positive - report.nearest_negatives[:, 0]).mean().item())
    _, subset = fixed_subset(model, datamodule, "val", None, 40, 0)
    with torch.no_grad():
        _, targets, labels = eval_embeddings(model.eval(), datamodule, subset)
    assert report.tolerance == pytest.approx(tolerance(targets, labels).item(), abs=1e-6)
    warmer = analyse(model, datamodule, temperature=1.0, max_samples=40).entropy.mean()
    assert warmer > analyse(model, datamodule, temperature=0.05, max_samples=40).entropy.mean()  # Wang & Liu: entropy grows with tau


def test_a_view_of_two_crops_an_image_is_analysed_by_its_first_crop():
    """SupCon's and TCL's `crops` view draws two crops of each image: the analyses embed the first, as the collapse
    monitor does (a (B, 2, C, H, W) batch reached the trunk)."""
    model = tiny_supcon().train()
    datamodule = digits(CROPS, batch_size=16)
    report = analyse(model, datamodule, max_samples=24)
    assert report.view == "crops" and report.positive.shape == (24,) and -1 <= report.tolerance <= 1
    similarity, variance = key_distribution(model, datamodule, views_per_image=2, max_samples=16)
    assert similarity.shape == variance.shape == (16,)


def test_tolerance_pools_the_labelled_classes_only():
    """Unlabelled images (label -1: STL-10's unlabeled split, a folder of unlabelled images) are of no class."""
    z = torch.cat([unit(0, 4, 3) + torch.tensor([5.0, 0, 0]), unit(1, 4, 3) + torch.tensor([0, 5.0, 0]), unit(2, 8, 3)])
    labels = torch.tensor([0] * 4 + [1] * 4 + [-1] * 8)
    torch.testing.assert_close(tolerance(z, labels), tolerance(z[:8], labels[:8]))
    with pytest.raises(ValueError, match="at least one class with two samples"):
        tolerance(z, torch.full((16,), -1))


class RecordingWandbLogger(WandbLogger):
    """A WandbLogger that records images instead of starting a W&B run."""

    def __init__(self):
        self.images = []

    def log_image(self, key, images, step=None, **kwargs):
        self.images.append((key, images, step))


def test_callback_writes_the_figures_and_sends_them_to_wandb(tmp_path):
    model, datamodule = tiny_npid(), digits({"image": {"preset": "npid"}}, batch_size=16)
    wandb = RecordingWandbLogger()
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True, datamodule=datamodule, default_root_dir=str(tmp_path),
                              current_epoch=4, global_step=50, loggers=[wandb])
    RepresentationAnalysis(max_samples=32).on_validation_epoch_end(trainer, model)
    for name in ("local_separation", "negative_entropy"):
        assert_png(tmp_path / "analysis" / f"epoch004_{name}.png")
    assert [(key, step) for key, _, step in wandb.images] == [("val/local_separation", 50), ("val/negative_entropy", 50)]


@pytest.mark.slow
def test_pretraining_logs_the_analysis_and_the_command_analyses_its_checkpoint(tmp_path, capsys):
    run_dir, config = tmp_path / "run", str(ROOT / "configs/npid_digits.yaml")
    data = ["--data.init_args.batch_size=16", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]
    monitors = ['--trainer.callbacks+={"class_path": "analysis.CollapseMonitor", "init_args": {"every_n_epochs": 1}}',
                "--trainer.callbacks+=analysis.EmbeddingMap"]
    main_pretrain.cli_main(["fit", "--config", config, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                            "--trainer.check_val_every_n_epoch=1", "--trainer.limit_val_batches=2", "--trainer.logger=false",
                            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run_dir}", *data, *monitors])
    logged = json.loads((run_dir / "results_val.json").read_text())["metrics"]
    assert {"val/uniformity", "val/tolerance", "val/negative_entropy", "val/local_separation"} <= set(logged)
    assert {"val/rankme_trunk", "val/rankme_projector", "val/projector_std", "val/projector_uniformity", "val/projector_alignment"} <= set(logged)  # the monitor's
    assert_png(run_dir / "analysis" / "epoch000_local_separation.png")
    assert_png(run_dir / "analysis" / "embedding_map.png")  # at the end of training

    out = tmp_path / "analysis"
    analyse_checkpoint([str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--max-samples", "50", "--out", str(out), "--", *data])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples"] == 50 and set(metrics) >= {"uniformity", "tolerance", "negative_entropy", "local_separation"}
    assert (metrics["config"], metrics["overrides"], metrics["dataset"]) == (config, data, "datamodules.digits.DigitsDataModule")  # what it measured
    assert (metrics["view"], metrics["temperature"]) == ("image", 0.1)  # configs/npid_digits.yaml's, the method's own: both change the numbers
    for name in ("local_separation", "negative_entropy"):
        assert_png(out / f"{name}.png")

    capsys.readouterr()
    command = [str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--out", str(out)]
    analyse_checkpoint(["embedding-map", *command, "--max-samples", "60", "--space", "embedding", "--", *data])
    assert capsys.readouterr().out.strip() == f"figure: {out / 'embedding_map.png'}"
    assert_png(out / "embedding_map.png")
    analyse_checkpoint(["few-shot", *command, "--shots", "1", "2", "--draws", "2", "--", *data])
    few_shot = json.loads((out / "few_shot.json").read_text())
    assert few_shot["format"] == "contrastlab" and few_shot["eval_images"] == 300 and list(few_shot["shots"]) == ["1", "2"]
    assert few_shot["checkpoint"] == str(run_dir / "checkpoints" / "last.ckpt") and few_shot["dataset"] == "datamodules.digits.DigitsDataModule"
    assert capsys.readouterr().out.splitlines()[0].startswith("  1-shot top-1 ")
    with pytest.raises(SystemExit, match=r"error: --model.init_args.temperature=0.5: a contrastlab checkpoint '.*' analyses the method it was trained with"):
        analyse_checkpoint([*command, "--", *data, "--model.init_args.temperature=0.5"])  # it would change nothing: said, not ignored


@pytest.mark.slow
def test_the_knn_command_gives_the_monitors_numbers_for_its_k_and_temperature_and_the_others_of_the_grid(tmp_path, capsys):
    """One extraction of the features for every (k, temperature): at the config's own (200, 0.07), the numbers the
    kNN monitor reported at the end of the run (fp32 both; the whole bank and validation split)."""
    run_dir, config = tmp_path / "run", str(ROOT / "configs/moco_digits.yaml")
    data = ["--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]
    main_pretrain.cli_main(["fit", "--config", config, "--trainer.max_steps=3", "--trainer.precision=32-true", "--trainer.logger=false",
                            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run_dir}", *data])
    monitored = json.loads((run_dir / "results_val.json").read_text())["metrics"]
    capsys.readouterr()
    analyse_checkpoint(["knn", str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--k", "200", "7", "--temperature", "0.07", "0.5", "--", *data])
    record = json.loads((run_dir / "analysis" / "last-val" / "knn.json").read_text())
    assert [(setting["k"], setting["temperature"]) for setting in record["settings"]] == [(200, 0.07), (200, 0.5), (7, 0.07), (7, 0.5)]
    assert record["settings"][0]["top1"] == pytest.approx(monitored["val/knn_top1"], abs=1e-6)
    assert record["settings"][0]["top5"] == pytest.approx(monitored["val/knn_top5"], abs=1e-6)
    assert (record["bank_split"], record["eval_images"], record["format"]) == ("train", 300, "contrastlab")
    assert capsys.readouterr().out.splitlines()[0].startswith("k  200  temperature 0.07    top-1 ")

    # the exported features are the ones the kNN voted with: the same top-1 from them and the training split's
    analyse_checkpoint(["features", str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--", *data])
    analyse_checkpoint(["features", str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--split", "train", "--", *data])
    analyse_checkpoint(["features", str(run_dir / "checkpoints" / "last.ckpt"), "--config", config, "--space", "embedding", "--", *data])
    assert capsys.readouterr().out.splitlines()[0] == f"300 images x 96 features (trunk, val): {run_dir / 'analysis' / 'last-val' / 'features-trunk.pt'}"
    val, train = (torch.load(run_dir / "analysis" / f"last-{split}" / "features-trunk.pt") for split in ("val", "train"))
    assert val["index"].tolist() == list(range(300)) and val["labels"].tolist() == composite_digits("val", 1)[1].tolist()
    assert (val["record"]["split"], val["record"]["space"], val["record"]["overrides"]) == ("val", "trunk", data)
    scores = knn_predict(F.normalize(val["features"], dim=1), F.normalize(train["features"], dim=1), train["labels"], 10, 200, 0.07)
    assert float(knn_topk_accuracy(scores, val["labels"], 1)) == pytest.approx(record["settings"][0]["top1"], abs=1e-6)
    embedding = torch.load(run_dir / "analysis" / "last-val" / "features-embedding.pt")
    assert embedding["features"].shape == (300, 128) and torch.allclose(embedding["features"].norm(dim=1), torch.ones(300))


def test_the_knn_command_refuses_to_evaluate_the_bank_and_names_a_misspelt_split_before_embedding_anything(monkeypatch):
    model, datamodule = tiny_npid(), digits({"image": {"preset": "npid"}}, batch_size=16)
    embedded = []
    monkeypatch.setattr(knn, "evaluated_features", lambda model, datamodule, dataset: embedded.append(dataset))  # the bank came first
    with pytest.raises(ValueError, match=r"^split 'train' is the kNN bank itself: give an evaluation split \(one of \['test', 'val'\]\)$"):
        knn_grid(model, datamodule, [5], [0.07], split="train")
    with pytest.raises(ValueError, match="split 'vall' is not one of"):
        knn_grid(model, datamodule, [5], [0.07], split="vall")
    assert embedded == []


@pytest.mark.parametrize(
    "arguments, message",
    [(["--max-samples", "-5"], "argument --max-samples: invalid positive_int value: '-5'"),
     (["embedding-map", "--max-samples", "0"], "argument --max-samples: invalid positive_int value: '0'"),
     (["knn", "--k", "200", "0"], "argument --k: invalid positive_int value: '0'"),
     (["knn", "--temperature", "-0.07"], "argument --temperature: invalid positive_float value: '-0.07'"),
     (["--temperature", "0"], "argument --temperature: invalid positive_float value: '0'"),  # named no option, after the checkpoint was read
     (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "nodevice"], "argument --device: invalid usable_device value:"),
     (["--device", f"cuda:{torch.cuda.device_count()}"], f"argument --device: invalid usable_device value: 'cuda:{torch.cuda.device_count()}'"),
     (["--device", "meta"], "argument --device: invalid usable_device value: 'meta'"),
     (["--device", "mps"], "argument --device: invalid usable_device value: 'mps'")],
)
def test_a_count_below_one_a_temperature_of_0_or_a_device_this_machine_lacks_is_refused_before_any_checkpoint_is_read(arguments, message, tmp_path, capsys):
    command = arguments[:1] if arguments[0] in ("embedding-map", "knn") else []
    with pytest.raises(SystemExit) as exit_info:
        analyse_checkpoint([*command, str(tmp_path / "absent.ckpt"), "--config", "configs/moco_digits.yaml", *arguments[len(command):]])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["embedding-map"], ["few-shot"], ["knn"], ["features"]], ids=["analysis", "embedding-map", "few-shot", "knn", "features"])
def test_an_output_folder_below_a_file_and_a_negative_seed_are_one_error_line_before_any_checkpoint_is_read(command, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit, match=rf"^error: the output folder {tmp_path / 'taken' / 'out'} cannot be a folder: {tmp_path / 'taken'} is a file$"):
        analyse_checkpoint([*command, str(tmp_path / "absent.ckpt"), "--config", "configs/moco_digits.yaml", "--out", str(tmp_path / "taken" / "out")])
    if command in (["embedding-map"], ["few-shot"]):  # the subcommands that draw with a seed
        with pytest.raises(SystemExit):
            analyse_checkpoint([*command, str(tmp_path / "absent.ckpt"), "--config", "configs/moco_digits.yaml", "--seed", "-1"])
        assert "argument --seed: invalid non_negative_int value: '-1'" in capsys.readouterr().err


def test_without_out_the_analysis_goes_to_the_checkpoint_s_run_or_beside_a_checkpoint_outside_one(tmp_path):
    from analysis.loading import default_out

    # a folder per checkpoint and split: another's analysis, and the training's embedding map in <run>/analysis, stay
    assert default_out(argparse.Namespace(out=None, split="val", checkpoint=tmp_path / "run" / "checkpoints" / "last.ckpt")) == tmp_path / "run" / "analysis" / "last-val"
    assert default_out(argparse.Namespace(out=None, split="test", checkpoint=tmp_path / "run" / "checkpoints" / "epoch=9.ckpt")) == tmp_path / "run" / "analysis" / "epoch=9-test"
    assert default_out(argparse.Namespace(out=None, split="val", checkpoint=tmp_path / "downloads" / "moco.ckpt")) == tmp_path / "downloads" / "analysis" / "moco-val"
    assert default_out(argparse.Namespace(out=tmp_path / "chosen", split="val", checkpoint=tmp_path / "downloads" / "moco.ckpt")) == tmp_path / "chosen"
