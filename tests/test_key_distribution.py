"""JCL's Fig. M.3 analysis: per-image similarity and variance of augmented embeddings, and its command."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import main_pretrain
from analysis.key_distribution import augmentation_statistics, key_distribution, main
from methods import JCL
from methods.momentum import MomentumSpec
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits

ROOT = Path(__file__).parents[1]


def test_similarity_and_variance_are_the_mean_over_all_pairs_and_the_mean_covariance_diagonal():
    embeddings = F.normalize(torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64), dim=-1)
    similarity, variance = augmentation_statistics(embeddings)
    for image, views in enumerate(embeddings.numpy()):
        pairs = [views[a] @ views[b] for a in range(7) for b in range(7)]
        assert similarity[image].item() == pytest.approx(np.mean(pairs), abs=1e-6)
        assert variance[image].item() == pytest.approx(np.diag(np.cov(views, rowvar=False, bias=True)).mean(), abs=1e-6)
    torch.testing.assert_close(variance, (1 - similarity) / 4)  # unit vectors: trace(Sigma) = 1 - |mu|^2


def tiny_jcl() -> JCL:
    return JCL(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=256, knn_k=0, momentum=MomentumSpec(shuffle_bn=False))


def test_a_deterministic_view_gives_identical_embeddings_and_augmentations_spread_them():
    model = tiny_jcl()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    views = {"query": {"preset": "mocov2"}, "keys": {"preset": "mocov2", "count": 2}, "fixed": {"preset": "center"}}
    datamodule = digits(views, batch_size=16)
    same_similarity, same_variance = key_distribution(model, datamodule, view="fixed", views_per_image=4, max_samples=24)
    assert same_similarity.shape == same_variance.shape == (24,)
    torch.testing.assert_close(same_similarity, torch.ones(24), atol=1e-5, rtol=0)
    assert same_variance.abs().max() < 1e-6
    similarity, variance = key_distribution(model, datamodule, views_per_image=4, max_samples=24)  # the query view
    assert similarity.max() < 1 - 1e-3 and variance.min() > 0
    torch.testing.assert_close(key_distribution(model, datamodule, views_per_image=4, max_samples=24)[0], similarity)  # seeded
    assert model.training  # the mode is restored
    # and it ran in eval mode: no BatchNorm statistic moved (in training mode they would, and the similarities with them)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_view_the_datamodule_lacks_is_refused():
    with pytest.raises(ValueError, match=r"view 'strong' is not among the DataModule's views \['query', 'keys'\]"):
        key_distribution(tiny_jcl(), digits({"query": {"preset": "mocov2"}, "keys": {"preset": "mocov2", "count": 2}}), view="strong")


@pytest.mark.slow
def test_the_command_overlays_the_histograms_of_checkpoints(tmp_path, capsys):
    run_dir, config = tmp_path / "run", str(ROOT / "configs/jcl_digits.yaml")
    data = ["--data.init_args.batch_size=16", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]
    main_pretrain.cli_main(["fit", "--config", config, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                            "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                            "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}", *data])
    out = tmp_path / "figures"
    checkpoint = str(run_dir / "checkpoints" / "last.ckpt")
    main(["--run", checkpoint, config, "--run", checkpoint, config, "again", "--views-per-image", "3", "--max-samples", "20",
          "--out", str(out), "--", *data])  # fmt: skip
    record = json.loads((out / "key_distribution.json").read_text())
    assert set(record) == {"JCL (jcl_digits)", "again"}
    assert record["JCL (jcl_digits)"]["images"] == 20
    assert 0 < record["JCL (jcl_digits)"]["similarity_mean"] < 1
    assert record["again"] == record["JCL (jcl_digits)"]  # the same checkpoint, the same seeded images and views
    assert (out / "key_distribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match=rf"^error: --run {checkpoint}: its label 'JCL \(jcl_digits\)' is another run's too; give each run a LABEL of its own$"):
        main(["--run", checkpoint, config, "--run", checkpoint, config, "--max-samples", "20", "--out", str(tmp_path / "twice"), "--", *data])
    assert not (tmp_path / "twice").exists()  # one histogram of the two would have been drawn, the other dropped
    with pytest.raises(SystemExit):
        main(["--run", checkpoint, config, "--max-samples", "-590", "--out", str(tmp_path / "negative")])
    assert "argument --max-samples: invalid positive_int value: '-590'" in capsys.readouterr().err


def test_the_command_refuses_an_unwritable_out_a_missing_device_and_model_overrides_before_analysing(tmp_path, capsys):
    """Each was a traceback, the first after every run was analysed; a model override was silently ignored."""
    (tmp_path / "a_file").write_text("")
    missing = str(tmp_path / "missing.ckpt")  # never read: the refusals come first
    with pytest.raises(SystemExit, match=rf"^error: --out {tmp_path / 'a_file' / 'kd'} cannot be a folder: {tmp_path / 'a_file'} is a file$"):
        main(["--run", missing, "configs/jcl_digits.yaml", "--out", str(tmp_path / "a_file" / "kd")])
    with pytest.raises(SystemExit, match="^error: --model.init_args.temperature=0.5: each run analyses the method its checkpoint was trained with"):
        main(["--run", missing, "configs/jcl_digits.yaml", "--out", str(tmp_path / "kd"), "--", "--model.init_args.temperature=0.5"])
    with pytest.raises(SystemExit):
        main(["--run", missing, "configs/jcl_digits.yaml", "--out", str(tmp_path / "kd"), "--device", "mps"])
    assert "argument --device: " in capsys.readouterr().err

