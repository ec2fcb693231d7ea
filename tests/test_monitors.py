"""Tests of the pretraining callbacks of analysis/monitors.py: the collapse monitor (what it measures, when, on which
images, what it logs) and the embedding map (the figure, its legend, the PNG, the W&B image)."""

import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from matplotlib.image import imread
from test_analysis import RecordingWandbLogger, assert_png

from analysis import CollapseMonitor, EmbeddingMap, RepresentationAnalysis
from analysis.embedding_map import class_names, class_subset, embedding_map_figure, map_embeddings, tsne
from analysis.figures import save_figure
from analysis.monitors import collapse_metrics, validation_samples
from analysis.representation import evaluated_features
from backbones import BackboneSpec
from methods import DINO, MoCoV2, NPID
from methods.momentum import MomentumSpec
from helpers import TINY_PROJECTOR, digits

SMALL_TRUNK = BackboneSpec(name="timm:test_resnet")  # 96-d features, the quickstart's trunk
MOCO_VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}
COLLAPSE_NAMES = {"rankme_trunk", "rankme_projector", "projector_std", "projector_uniformity", "projector_alignment"}


def tiny_moco() -> MoCoV2:
    return MoCoV2(backbone=SMALL_TRUNK, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0).train()


def fake_trainer(datamodule, tmp_path, **kwargs) -> SimpleNamespace:
    options = dict(sanity_checking=False, is_global_zero=True, datamodule=datamodule, default_root_dir=str(tmp_path), current_epoch=4,
                   global_step=50, loggers=[], callbacks=[], limit_val_batches=1.0, fast_dev_run=False, max_epochs=100, should_stop=False,
                   state=SimpleNamespace(fn="fit"))
    return SimpleNamespace(**(options | kwargs))


def logged_names(monkeypatch, model) -> list[str]:
    names = []
    monkeypatch.setattr(model, "log", lambda name, value, **kwargs: names.append(name))
    return names


@pytest.mark.slow
def test_collapse_metrics_are_the_same_at_every_call_in_eval_mode_and_leave_the_random_streams_alone():
    model, datamodule = tiny_moco(), digits(MOCO_VIEWS, batch_size=16)
    state, python_state = torch.random.get_rng_state(), random.getstate()
    metrics = collapse_metrics(model, datamodule, max_samples=24)
    assert torch.equal(torch.random.get_rng_state(), state) and random.getstate() == python_state and model.training
    assert collapse_metrics(model, datamodule, max_samples=24) == metrics  # the same images and augmentations
    # in eval mode: a model put there first gives the same numbers (BatchNorm on batch statistics would not)
    assert collapse_metrics(model.eval(), datamodule, max_samples=24) == metrics
    assert set(metrics) == COLLAPSE_NAMES
    assert 1 <= metrics["rankme_trunk"] <= 24 and 1 <= metrics["rankme_projector"] <= 24  # at most min(N, D)
    assert 0 <= metrics["projector_std"] <= 1 and 0 < metrics["projector_uniformity"] <= 4 and 0 <= metrics["projector_alignment"] <= 4
    assert metrics["projector_alignment"] > 0  # two different augmentations of each image


def test_a_collapsed_projector_reads_as_collapsed_while_the_trunk_does_not():
    """Every projection the same vector: rank 1 and no spread, measured on the projections, not on the trunk's features."""
    model, datamodule = tiny_moco(), digits(MOCO_VIEWS, batch_size=16)
    model.projector = torch.nn.Linear(model.feature_dim, 8)
    with torch.no_grad():
        model.projector.weight.zero_()
        model.projector.bias.copy_(torch.arange(1.0, 9.0))
    metrics = collapse_metrics(model, datamodule, max_samples=24)
    assert metrics["rankme_projector"] == pytest.approx(1.0, abs=1e-3) and metrics["projector_std"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rankme_trunk"] > 2


def test_the_two_views_of_a_one_view_method_are_two_draws_of_its_view():
    model, datamodule = NPID(backbone=SMALL_TRUNK, projector=TINY_PROJECTOR, temperature=0.2, knn_k=0), digits({"image": {"preset": "npid"}}, batch_size=16)
    assert collapse_metrics(model, datamodule, max_samples=16)["projector_alignment"] > 0
    with pytest.raises(ValueError, match=r"view 'weak' is not among the DataModule's views \['image'\]"):
        collapse_metrics(model, datamodule, views=["image", "weak"], max_samples=16)


def test_the_monitor_logs_at_the_end_of_every_nth_and_of_the_last_epoch_under_names_of_its_own(tmp_path, monkeypatch):
    model, datamodule = tiny_moco(), digits(MOCO_VIEWS, batch_size=16)
    names = logged_names(monkeypatch, model)
    monitor = CollapseMonitor(every_n_epochs=5, max_samples=16)
    monitor.setup(fake_trainer(datamodule, tmp_path), model, "fit")
    for epoch in (0, 3, 5, 8):  # epochs 1, 4, 6 and 9 end
        monitor.on_validation_epoch_end(fake_trainer(datamodule, tmp_path, current_epoch=epoch), model)
    assert names == []
    monitor.on_validation_epoch_end(fake_trainer(datamodule, tmp_path, current_epoch=9), model)
    assert names == [f"val/{name}" for name in ("rankme_trunk", "rankme_projector", "projector_std", "projector_uniformity", "projector_alignment")]
    for last in (dict(current_epoch=11, max_epochs=12), dict(current_epoch=6, should_stop=True), dict(current_epoch=6, state=SimpleNamespace(fn="validate"))):
        # the results' validation: max_epochs, max_steps, a validation after the fit (validate_the_end_if_missed)
        names.clear()
        monitor.on_validation_epoch_end(fake_trainer(datamodule, tmp_path, **last), model)
        assert len(names) == 5

    names.clear()  # beside RepresentationAnalysis, whose val/uniformity is of other embeddings, nothing is left out
    with_analysis = fake_trainer(datamodule, tmp_path, callbacks=[RepresentationAnalysis(), monitor])
    monitor.setup(with_analysis, model, "fit")
    monitor.on_validation_epoch_end(with_analysis, model)
    assert "val/uniformity" not in names and len(names) == 5


def test_the_monitor_and_the_map_skip_a_module_that_is_not_a_pretraining_method_and_can_be_turned_off(tmp_path):
    trainer = fake_trainer(None, tmp_path)  # no DataModule: touching it would fail
    for module, enabled in ((L.LightningModule(), True), (tiny_moco(), False)):
        for callback, hook in ((CollapseMonitor(every_n_epochs=1, enabled=enabled), "on_validation_epoch_end"),
                               (EmbeddingMap(enabled=enabled), "on_train_end")):
            callback.setup(trainer, module, "fit")
            getattr(callback, hook)(trainer, module)
    assert not (tmp_path / "analysis").exists()


def test_the_callbacks_take_no_more_images_than_the_run_validates_on():
    datamodule = digits(MOCO_VIEWS, batch_size=16)  # 300 validation images
    limits = {1.0: 300, 0.5: 150, 3: 48, 0: 0}
    assert {limit: validation_samples(SimpleNamespace(limit_val_batches=limit), datamodule, "val", 1024) for limit in limits} == limits
    assert validation_samples(SimpleNamespace(limit_val_batches=1.0), datamodule, "val", 100) == 100
    assert validation_samples(SimpleNamespace(limit_val_batches=1.0), datamodule, "bank", 100) == 0  # Digits-M has no bank split


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: CollapseMonitor(every_n_epochs=0), "every_n_epochs must be >= 1, got 0"),
        (lambda: CollapseMonitor(max_samples=1), "max_samples must be >= 2, got 1"),
        (lambda: EmbeddingMap(space="logits"), "space must be 'trunk' or 'embedding', got 'logits'"),
        (lambda: EmbeddingMap(max_classes=21), r"max_classes must lie in \[1, 20\]"),
    ],
)
def test_bad_callback_arguments_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.slow
def test_the_embedding_map_shows_every_class_in_its_legend_and_is_written_as_a_png(tmp_path):
    model, datamodule = tiny_moco(), digits(MOCO_VIEWS, batch_size=32)
    embeddings, labels = map_embeddings(model, datamodule, max_samples=60, max_classes=4)
    assert embeddings.shape == (60, 96) and set(labels.tolist()) == {0, 1, 2, 3}
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(60))
    points = tsne(embeddings)
    assert points.shape == (60, 2) and np.array_equal(points, tsne(embeddings))  # seeded
    figure = embedding_map_figure(points, labels, class_names(datamodule), "a map")
    legend = figure.axes[0].get_legend()
    assert legend.get_title().get_text() == "class" and [text.get_text() for text in legend.get_texts()] == ["0", "1", "2", "3"]
    path = save_figure(figure, tmp_path / "map.png")
    assert_png(path)
    pixels = imread(path)
    assert pixels.std() > 0.01 and len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10  # drawn, in several colours


@pytest.mark.slow
def test_the_trunk_map_of_dino_is_of_its_teacher_the_trunk_its_linear_probe_and_knn_read():
    model = DINO(backbone=SMALL_TRUNK, out_dim=20, knn_k=0, projector=TINY_PROJECTOR)
    with torch.no_grad():
        for parameter in model.target_backbone.parameters():  # a teacher that differs from the student
            parameter.add_(0.1 * torch.randn_like(parameter))
    datamodule = digits(MOCO_VIEWS, batch_size=32)
    embeddings, labels = map_embeddings(model, datamodule, max_samples=40, max_classes=4)
    features, same_labels = evaluated_features(model.eval(), datamodule, class_subset(datamodule, "val", 40, 4, 0))
    assert torch.equal(labels, same_labels) and torch.equal(embeddings, torch.nn.functional.normalize(features, dim=1))


def test_the_map_callback_writes_the_png_beside_the_run_and_sends_it_to_wandb_but_not_in_a_fast_dev_run(tmp_path):
    model, datamodule = tiny_moco(), digits(MOCO_VIEWS, batch_size=16)
    callback, wandb = EmbeddingMap(max_classes=3), RecordingWandbLogger()
    quick = fake_trainer(datamodule, tmp_path / "quick", fast_dev_run=1, loggers=[wandb])
    callback.setup(quick, model, "fit")
    callback.on_train_end(quick, model)
    assert not (tmp_path / "quick").exists() and wandb.images == []

    trainer = fake_trainer(datamodule, tmp_path, loggers=[wandb], limit_val_batches=2)  # 32 images
    callback.on_train_end(trainer, model)
    assert_png(tmp_path / "analysis" / "embedding_map.png")
    assert wandb.images == [("val/embedding_map", [str(tmp_path / "analysis" / "embedding_map.png")], 50)]


@pytest.mark.parametrize("override", [["--trainer.limit_train_batches", "2"], ["--trainer.max_epochs=1"]])
def test_the_cost_benchmark_refuses_a_trainer_setting_it_would_not_use(override):
    """It trains with a Lightning trainer of its own and printed the override in its header as if it had applied it."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import monitor_cost

    with pytest.raises(SystemExit, match=rf"^error: {re.escape(override[0])}: this benchmark reads only --trainer.precision"):
        monitor_cost.main(["--config", "configs/moco_digits.yaml", "--", *override])
