"""JCL: M' key views per image, their mean and covariance, the loss it calls, what is enqueued, cost, training."""

import numpy as np
import pytest
import torch
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch, fixed_batch_loss

from engine.config import RampSpec
from methods import JCL
from methods.losses import info_nce, jcl_loss
from methods.momentum import MomentumSpec


def jcl_views(num_keys: int) -> dict:
    return {"query": {"preset": "mocov2"}, "keys": {"preset": "mocov2", "count": num_keys}}


def tiny_jcl(**kwargs) -> JCL:
    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=256, temperature=0.2, jcl_lambda=4.0,
                   momentum=MomentumSpec(base=0.99, shuffle_bn=False), knn_k=0)
    return JCL(**(options | kwargs))


def keys_encoded_view_by_view(model: JCL, key_views: torch.Tensor) -> np.ndarray:
    """(B, M', D) keys from one target forward of the views concatenated view-major (the official
    code's order; BatchNorm batch statistics do not depend on the order), in float64."""
    num_keys = key_views.shape[1]
    with torch.no_grad():
        keys = model.target_embed(torch.cat([key_views[:, m] for m in range(num_keys)]))
    return keys.unflatten(0, (num_keys, -1)).transpose(0, 1).double().numpy()


def test_the_key_views_of_an_image_are_independent_augmentations():
    batch = first_batch(digits(jcl_views(3), batch_size=8))
    key_views = batch["views"]["keys"]
    assert key_views.shape == (8, 3, 3, 32, 32)
    for image, query in zip(key_views, batch["views"]["query"]):
        for a in range(3):
            assert (image[a] - query).abs().max() > 0.1
            for b in range(a + 1, 3):
                assert (image[a] - image[b]).abs().max() > 0.1


def test_mean_and_covariance_of_the_keys_are_those_of_eq_s3_and_the_means_are_enqueued():
    model = tiny_jcl(temperature=0.2, jcl_lambda=4.0)
    batch = first_batch(digits(jcl_views(4), batch_size=16))
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    keys = keys_encoded_view_by_view(model, batch["views"]["keys"])
    with torch.no_grad():
        query = model.embed(batch["views"]["query"])[1].double().numpy()
    mean = keys.mean(axis=1)
    covariance = np.stack([np.cov(image_keys, rowvar=False, bias=True) for image_keys in keys])
    # Eq. S.3 written out with the full (B, D, D) covariance, in float64
    positive = (query * mean).sum(1) / 0.2 + 4.0 / (2 * 0.2**2) * np.einsum("bd,bde,be->b", query, covariance, query)
    negatives = query @ queue_before.double().numpy().T / 0.2
    expected = np.logaddexp(positive, np.logaddexp.reduce(negatives, axis=1)) - (query * mean).sum(1) / 0.2
    assert loss.item() == pytest.approx(expected.mean(), rel=1e-5)
    np.testing.assert_allclose(model.queue.keys[:16].double().numpy(), mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.queue.keys[16:], queue_before[16:])
    assert model.queue.pointer.item() == 16
    assert np.linalg.norm(mean, axis=1).max() < 1.0  # mu is enqueued as is, not re-normalised


def test_the_method_loss_is_jcl_loss_on_its_query_keys_queue_and_ramped_lambda(monkeypatch):
    model = tiny_jcl(temperature=0.2, jcl_lambda=2.0, lambda_ramp=RampSpec(start=0.01, epochs=199, unit="epoch"))
    monkeypatch.setattr(JCL, "epochs_done", property(lambda self: 9.5))  # epoch index 9 -> 2.0 * 10 / 200
    assert model.scheduled_lambda() == pytest.approx(0.1)
    batch = first_batch(digits(jcl_views(3), batch_size=16))
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        query = model.embed(batch["views"]["query"])[1]
    keys = torch.from_numpy(keys_encoded_view_by_view(model, batch["views"]["keys"])).float()
    torch.testing.assert_close(loss, jcl_loss(query, keys, queue_before, 0.2, 0.1), rtol=1e-5, atol=1e-6)


def test_the_official_lambda_ramp_is_linear_per_epoch_up_to_lambda_at_the_last_epoch(monkeypatch):
    epochs = 200
    model = tiny_jcl(jcl_lambda=2.0, lambda_ramp=RampSpec(start=2.0 / epochs, epochs=epochs - 1, unit="epoch"))
    for epochs_done in [0.0, 0.7, 1.0, 57.3, 199.0, 199.9]:
        monkeypatch.setattr(JCL, "epochs_done", property(lambda self, value=epochs_done: value))
        assert model.scheduled_lambda() == pytest.approx(2.0 * (int(epochs_done) + 1) / epochs)
    assert tiny_jcl(jcl_lambda=2.0).scheduled_lambda() == 2.0


def test_a_single_key_view_gives_moco_v2_with_that_key():
    model = tiny_jcl(jcl_lambda=4.0)
    batch = first_batch(digits(jcl_views(1), batch_size=16))
    assert batch["views"]["keys"].shape == (16, 3, 32, 32)
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        query = model.embed(batch["views"]["query"])[1]
        key = model.target_embed(batch["views"]["keys"])
    torch.testing.assert_close(loss, info_nce(query, key, queue_before, 0.2), rtol=1e-5, atol=1e-6)  # MoCo v2's InfoNCE
    torch.testing.assert_close(model.queue.keys[:16], key)


def test_no_gradient_reaches_the_target_branch_and_the_keys_carry_no_graph():
    model = tiny_jcl()
    batch = first_batch(digits(jcl_views(3), batch_size=16))
    assert not model.embed_keys(batch["views"]["keys"]).requires_grad
    loss, _ = model.step(batch)
    loss.backward()
    assert all(p.grad is None for p in [*model.target_backbone.parameters(), *model.target_projector.parameters()])
    assert model.backbone.conv1.weight.grad.abs().sum() > 0
    assert not model.queue.keys.requires_grad


def bytes_saved_for_backward(model: JCL, batch: dict) -> int:
    saved = []
    pack = lambda tensor: saved.append(tensor.numel() * tensor.element_size()) or tensor  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.step(batch)
    return sum(saved)


def test_memory_kept_for_backward_grows_with_m_only_by_the_small_key_tensor():
    model = tiny_jcl()
    datamodule_1, datamodule_8 = digits(jcl_views(1), batch_size=16), digits(jcl_views(8), batch_size=16)
    one_key = bytes_saved_for_backward(model, first_batch(datamodule_1))
    eight_keys = bytes_saved_for_backward(model, first_batch(datamodule_8))
    key_tensor_bytes = 16 * 8 * TINY_PROJECTOR.output_dim * 4
    assert one_key > 100 * key_tensor_bytes  # the online trunk's activations dominate ...
    assert eight_keys - one_key <= 3 * key_tensor_bytes  # ... and do not grow with M' (no backward through keys)


def test_bad_jcl_settings_are_refused_with_their_values():
    with pytest.raises(ValueError, match="jcl_lambda must be >= 0, got -1.0"):
        tiny_jcl(jcl_lambda=-1.0)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        tiny_jcl(temperature=0.0)
    with pytest.raises(ValueError, match=r"^model.lambda_ramp.start as jcl_lambda must be >= 0, got -0.5$"):
        tiny_jcl(lambda_ramp=RampSpec(start=-0.5, epochs=10))
    with pytest.raises(ValueError, match=r"^a ramp needs epochs > 0, got 0$"):  # the official ramp over E - 1 epochs of a 1-epoch run
        tiny_jcl(lambda_ramp={"start": 4.0, "epochs": 0, "unit": "epoch"})
    with pytest.raises(ValueError, match=r"consumes the views \['query', 'keys'\] but data.views provides \['query', 'key'\]"):
        tiny_jcl().check_data(digits({"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}), world_size=1)


@pytest.mark.slow
def test_jcl_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_jcl()
    datamodule = digits(jcl_views(2), batch_size=32)
    batch = first_batch(datamodule)
    queue = model.queue.read()
    before = fixed_batch_loss(model, batch, queue)
    cpu_trainer(tmp_path, max_steps=12, limit_val_batches=0).fit(model, datamodule)
    after = fixed_batch_loss(model, batch, queue)
    assert after < before - 0.1 * abs(before), (before, after)
