import lightning as L
import pytest
import torch
import torch.nn.functional as F

from datamodules import DigitsDataModule
from methods import NPID
from methods.losses import contrastive_loss
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch

NPID_VIEWS = {"image": {"preset": "npid"}}
BANK_SIZE = 100


def tiny_npid(**kwargs) -> NPID:
    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.1, knn_k=0)
    model = NPID(**(options | kwargs))
    model.build_bank(BANK_SIZE)
    return model


def batch_inside_the_bank(batch_size: int = 16) -> dict:
    """A training batch whose sample indices lie inside the tiny bank."""
    batch = first_batch(digits(NPID_VIEWS, batch_size=batch_size))
    batch["index"] = torch.randperm(BANK_SIZE)[:batch_size]
    return batch


def embedding_of(model: NPID, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.embed(batch["views"]["image"])[1]


def test_bank_update_follows_the_momentum_rule_by_sample_index():
    model = tiny_npid(bank_momentum=0.5)
    batch = batch_inside_the_bank()
    before = model.bank.read()
    embedding = embedding_of(model, batch)
    model.step(batch)
    index = batch["index"]
    expected = F.normalize(0.5 * before[index] + 0.5 * embedding, dim=1)
    torch.testing.assert_close(model.bank.entries[index], expected, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(BANK_SIZE, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(model.bank.entries[untouched], before[untouched])


def test_loss_contrasts_the_own_bank_entry_with_every_other_entry_before_the_update():
    model = tiny_npid()
    batch = batch_inside_the_bank()
    bank = model.bank.read()
    loss, features = model.step(batch)
    index = batch["index"]
    expected = contrastive_loss(embedding_of(model, batch), bank[index], bank, 0.1, exclude=index)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert features.shape == (16, model.feature_dim)


def test_hard_loss_with_num_hard_at_least_the_bank_size_equals_the_ordinary_loss_in_a_training_step():
    batch = batch_inside_the_bank()
    results = {}
    for name, options in {"ordinary": {}, "hard": {"loss": "hard", "num_hard": BANK_SIZE}, "hardest5": {"loss": "hard", "num_hard": 5}}.items():
        L.seed_everything(0, verbose=False)
        model = tiny_npid(**options)
        loss, _ = model.step(batch)
        loss.backward()
        results[name] = (loss.detach(), model.backbone.conv1.weight.grad.clone(), model.bank.read())
    for ordinary, hard in zip(results["ordinary"], results["hard"]):
        torch.testing.assert_close(hard, ordinary, rtol=1e-5, atol=1e-7)
    assert results["hardest5"][0] < results["ordinary"][0] - 0.1  # fewer negatives: a smaller denominator


def author_code_loss(embedding, bank, index, temperature, n_background=None):
    """WangFeng18/UnsupervisedLearningCodes objective.py, PointLoss and HardNegativePointLoss, in plain
    tensor operations: -(p + 1e-7).log().mean(), p = exp(s_i / t) / (sum of exp(s / t) over the bank, or
    over its n_background most similar entries)."""
    similarities = torch.exp(embedding @ bank.T / temperature)
    positive = similarities[torch.arange(len(index)), index]
    background = similarities if n_background is None else similarities.topk(n_background, dim=1).values
    return -(positive / background.sum(dim=1) + 1e-7).log().mean()


@pytest.mark.parametrize("loss, temperature, noise", [("ordinary", 0.07, 3.0), ("ordinary", 0.5, 3.0), ("hard", 0.07, 0.05)])
def test_loss_with_the_author_guard_equals_minus_log_of_p_plus_1e7(loss, temperature, noise):
    model = tiny_npid(temperature=temperature, loss=loss, num_hard=7, log_eps=1e-7).double()
    batch = batch_inside_the_bank()
    batch["views"]["image"] = batch["views"]["image"].double()
    index = batch["index"]
    embedding = embedding_of(model, batch)
    # the own bank entry a noisy copy of the embedding: at noise 3 as far as the rest (p small, as early in
    # training, where the guard matters most); at 0.05 the most similar entry, which the author's hard loss
    # needs to keep it among its top 8 (own entry + 7 negatives, our num_hard 7)
    noisy = embedding + noise * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0), dtype=embedding.dtype)
    model.bank.entries[index] = F.normalize(noisy, dim=1)
    bank = model.bank.read()
    if loss == "hard":
        assert torch.equal((embedding @ bank.T).argmax(dim=1), index)
    step_loss, _ = model.step(batch)
    expected = author_code_loss(embedding, bank, index, temperature, n_background=8 if loss == "hard" else None)
    torch.testing.assert_close(step_loss, expected, rtol=1e-12, atol=1e-12)
    unguarded = contrastive_loss(embedding, bank[index], bank, temperature, num_hard=model.num_hard, exclude=index)
    assert (unguarded - step_loss).abs() > 1e-9  # the guard is not a no-op on these inputs


@pytest.mark.slow
def test_bank_is_sized_from_the_training_split_and_survives_a_checkpoint(tmp_path):
    model = NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0)
    datamodule = digits(NPID_VIEWS, batch_size=32)
    trainer = cpu_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    trainer.fit(model, datamodule)
    assert model.bank.entries.shape == (len(datamodule.splits["train"]), model.projection_dim)
    trainer.save_checkpoint(tmp_path / "npid.ckpt")
    restored = NPID.load_from_checkpoint(tmp_path / "npid.ckpt")  # outside a Trainer: sized by the checkpoint
    assert torch.equal(restored.bank.entries, model.bank.entries)


def test_a_second_fit_on_another_training_split_is_refused_and_a_hard_loss_over_the_whole_bank_is_a_warning(tmp_path, recwarn):
    """The bank has one entry per training image of its first fit: another split left stale entries among the negatives,
    or an IndexError mid-run."""
    model = NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0, loss="hard", num_hard=4095)
    cpu_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(model, digits(NPID_VIEWS, batch_size=32))
    assert [str(w.message) for w in recwarn if "num_hard" in str(w.message)] == [
        "model.init_args.num_hard 4095 keeps all 1196 negatives of the 1197-entry bank: the hard loss is the ordinary one here"]
    twice = DigitsDataModule(batch_size=32, num_workers=0, views=NPID_VIEWS, train_variants=2, eval_variants=1)
    with pytest.raises(ValueError, match=r"^NPID's memory bank holds one entry per image of the training split it was built for \(1197\), but DigitsDataModule's has 2394"):
        cpu_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(model, twice)


def test_setup_without_a_datamodule_is_refused(tmp_path):
    model = NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0)
    loader = digits(NPID_VIEWS).train_dataloader()
    with pytest.raises(ValueError, match="sizes its memory bank from the DataModule's training split"):
        cpu_trainer(tmp_path, max_steps=1).fit(model, loader)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss": "soft"}, "loss must be 'ordinary' or 'hard', got 'soft'"),
        ({"loss": "hard", "num_hard": 0}, "num_hard must be >= 1, got 0"),
        ({"bank_momentum": 1.0}, r"bank_momentum must lie in \[0, 1\), got 1.0"),
        ({"temperature": 0.0}, "temperature must be > 0, got 0.0"),
        ({"log_eps": -1e-7}, "log_eps must be >= 0, got -1e-07"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, **options)
