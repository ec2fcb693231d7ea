"""The Python API of docs/usage.md: a method and a DataModule trained by a plain `lightning.Trainer`, no CLI."""

import re
from pathlib import Path

import torch

DOCUMENTED = Path(__file__).parents[1] / "docs" / "usage.md"


def documented_example() -> str:
    section = DOCUMENTED.read_text().split("## From Python, without the CLI", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_documented_python_example_trains_and_gives_trunk_features(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Lightning writes its checkpoints under the working directory
    code = documented_example().replace("limit_train_batches=20", "limit_train_batches=2, limit_val_batches=1")
    namespace: dict = {}
    exec(compile(code, str(DOCUMENTED), "exec"), namespace)
    trainer, model, features = namespace["trainer"], namespace["model"], namespace["features"]
    assert trainer.global_step == 2
    assert features.shape == (1, model.feature_dim) and torch.isfinite(features).all()
    assert model.queue.pointer.item() == 2 * 64  # two batches of keys enqueued
    assert [path.relative_to(tmp_path).parts[:2] for path in tmp_path.rglob("*.ckpt")] == [("runs", "python_api")]  # not ./checkpoints
