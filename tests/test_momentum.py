import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from methods import MoCoV2
from methods.momentum import MomentumMixin, MomentumSpec, ema_update_, momentum_at
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue, MemoryBank
from methods.shuffle_bn import SplitBatchNorm2d, convert_to_split_batchnorm, distributed_shuffled_forward
from helpers import TINY_BACKBONE, TINY_PROJECTOR, free_port, start_processes


# ------------------------------------------------------------------ EMA and its schedules
def test_a_target_has_no_stochastic_depth_or_dropout_while_its_online_trunk_keeps_them():
    """facebookresearch/dino main_dino.py gives drop_path_rate to the student only; moco-v3's and BYOL's targets have
    none: a target's outputs are deterministic."""
    vit = {"name": "vit_tiny", "kwargs": {"img_size": 32, "patch_size": 8, "depth": 2, "drop_path_rate": 0.3, "proj_drop_rate": 0.2, "pos_drop_rate": 0.2}}
    model = MoCoV2(backbone=vit, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    rates = lambda trunk: sorted({round(getattr(module, "drop_prob", getattr(module, "p", 0.0)), 6) for module in trunk.modules()  # noqa: E731
                                  if hasattr(module, "drop_prob") or isinstance(module, nn.Dropout)})
    assert rates(model.backbone) == [0.0, 0.2, 0.3] and rates(model.target_backbone) == [0.0]
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.target_embed(images), model.target_embed(images), rtol=0, atol=0)  # train mode


def test_constant_momentum_is_the_same_at_every_step():
    assert [momentum_at(step, 100, 0.99, "constant") for step in (0, 50, 99)] == [0.99] * 3


def test_cosine_momentum_goes_from_base_to_exactly_one():
    total, base = 101, 0.99
    assert momentum_at(0, total, base, "cosine") == pytest.approx(base, abs=1e-15)
    assert momentum_at(50, total, base, "cosine") == pytest.approx(base + (1 - base) / 2, abs=1e-15)
    assert momentum_at(100, total, base, "cosine") == 1.0
    # m_t = 1 - (1 - m_0)(cos(pi t / T) + 1) / 2 with T = total - 1 (SCE; eztorch's momentum scheduler)
    assert momentum_at(25, total, base, "cosine") == pytest.approx(1 - 0.01 * (math.cos(math.pi / 4) + 1) / 2, abs=1e-15)
    values = [momentum_at(step, total, base, "cosine") for step in range(total)]
    assert all(a <= b for a, b in zip(values, values[1:]))


def test_byol_cosine_momentum_is_tau_k_of_the_step_just_taken_at_the_first_middle_and_last_step():
    total, base = 100, 0.996  # tau_k = 1 - (1 - tau_base)(cos(pi k / K) + 1) / 2 (deepmind-research byol/utils/schedules.py)
    assert momentum_at(0, total, base, "cosine_byol") == pytest.approx(base, abs=1e-15)
    assert momentum_at(50, total, base, "cosine_byol") == pytest.approx(base + (1 - base) / 2, abs=1e-15)
    assert momentum_at(99, total, base, "cosine_byol") == pytest.approx(1 - 0.004 * (math.cos(math.pi * 99 / 100) + 1) / 2, abs=1e-15)
    assert momentum_at(99, total, base, "cosine_byol") < 1.0  # the last update keeps a little of the online network


def test_mocov3_cosine_momentum_is_the_official_one_of_the_next_step_and_ends_at_exactly_one():
    total, base = 100, 0.99  # m = 1 - (1 + cos(pi e / E)) / 2 (1 - m_0) at e = epoch + i / iters (moco-v3 main_moco.py)
    official = lambda step: 1 - 0.5 * (1 + math.cos(math.pi * step / total)) * (1 - base)  # noqa: E731
    for step in (0, 49, 99):
        assert momentum_at(step, total, base, "cosine_mocov3") == pytest.approx(official(step + 1), abs=1e-15)
    assert momentum_at(49, total, base, "cosine_mocov3") == pytest.approx(base + (1 - base) / 2, abs=1e-15)
    assert momentum_at(99, total, base, "cosine_mocov3") == 1.0


def _pair():
    online = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    target = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    online[1].running_mean.fill_(5.0)
    return online, target


def test_ema_update_mixes_parameters_with_the_momentum():
    online, target = _pair()
    before = [p.clone() for p in target.parameters()]
    ema_update_(online, target, 0.9)
    for after, old, new in zip(target.parameters(), before, online.parameters()):
        torch.testing.assert_close(after, 0.9 * old + 0.1 * new)


def test_ema_with_momentum_one_freezes_and_zero_copies():
    online, target = _pair()
    frozen = [p.clone() for p in target.parameters()]
    ema_update_(online, target, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), frozen))
    ema_update_(online, target, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), online.parameters()))


def test_ema_leaves_batchnorm_buffers_alone():
    online, target = _pair()
    ema_update_(online, target, 0.0)
    assert torch.equal(target[1].running_mean, torch.zeros(3))


# ------------------------------------------------------------------ queue
def test_queue_starts_with_unit_keys_and_random_labels_in_range():
    torch.manual_seed(0)
    queue = KeyQueue(size=64, dim=8, num_classes=5)
    torch.testing.assert_close(queue.keys.norm(dim=1), torch.ones(64))
    assert queue.labels.unique().tolist() == [0, 1, 2, 3, 4]  # drawn over every class (a constant label is not random)


def test_queue_is_fifo_and_every_slot_is_replaced_once_per_cycle():
    queue = KeyQueue(size=8, dim=2)
    batches = [torch.full((2, 2), float(step)) for step in range(4)]
    for batch in batches:
        queue.push(batch)
    assert queue.pointer.item() == 0
    torch.testing.assert_close(queue.keys[:, 0], torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3]))
    queue.push(torch.full((2, 2), 4.0))  # the oldest entries go first
    torch.testing.assert_close(queue.keys[:, 0], torch.tensor([4.0, 4, 1, 1, 2, 2, 3, 3]))


def test_queue_wraps_around_when_its_size_is_not_a_multiple_of_the_batch():
    queue = KeyQueue(size=5, dim=1, num_classes=10)
    queue.push(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([1, 2, 3]))
    queue.push(torch.tensor([[4.0], [5.0], [6.0]]), torch.tensor([4, 5, 6]))
    assert queue.keys.flatten().tolist() == [6.0, 2.0, 3.0, 4.0, 5.0]
    assert queue.labels.tolist() == [6, 2, 3, 4, 5]  # labels stay aligned with their keys
    assert queue.pointer.item() == 1


def test_a_push_of_more_keys_than_the_queue_holds_is_refused():
    """A method that enqueues more keys per image than its keys_per_sample says passes the size check before training;
    its pushes then wrote 128 keys into 100 slots (some twice), silently."""
    queue = KeyQueue(size=4, dim=2)
    with pytest.raises(ValueError, match=r"^5 keys pushed into a queue of 4: a step's keys must fit \(the method's keys_per_sample\)$"):
        queue.push(torch.ones(5, 2))


def test_queue_read_is_a_detached_copy_unaffected_by_later_pushes():
    queue = KeyQueue(size=4, dim=2)
    snapshot = queue.read()
    queue.push(torch.ones(2, 2, requires_grad=True))
    assert not torch.equal(snapshot, queue.keys)
    assert not queue.keys.requires_grad


def test_queue_state_is_saved_and_restored_with_the_state_dict():
    queue = KeyQueue(size=6, dim=3, num_classes=4)
    queue.push(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]))
    restored = KeyQueue(size=6, dim=3, num_classes=4)
    restored.load_state_dict(queue.state_dict())
    assert set(queue.state_dict()) == {"keys", "labels", "pointer"}
    assert torch.equal(restored.keys, queue.keys) and torch.equal(restored.labels, queue.labels)
    assert restored.pointer.item() == 4


def test_queue_that_keeps_labels_refuses_keys_without_labels():
    queue = KeyQueue(size=4, dim=2, num_classes=3)
    with pytest.raises(ValueError, match="labels must be given"):
        queue.push(torch.randn(2, 2))


# ------------------------------------------------------------------ memory bank
def test_memory_bank_starts_uniform_in_npid_range():
    torch.manual_seed(0)
    entries = MemoryBank(size=1000, dim=128).entries
    bound = 1 / math.sqrt(128 / 3)
    assert entries.abs().max() <= bound and entries.max() > 0.99 * bound and entries.min() < -0.99 * bound
    # uniform on [-b, b]: mean 0, standard deviation b / sqrt(3), half of the values within b / 2 (128,000 draws)
    assert abs(entries.mean().item()) < 0.01 * bound
    assert entries.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.01)
    assert (entries.abs() < bound / 2).float().mean().item() == pytest.approx(0.5, abs=0.01)


def test_split_batchnorm_keys_are_encoded_from_a_shuffled_batch_and_returned_in_the_batchs_order():
    """One device, shuffle_bn with split_bn (MoCo's shuffle-BN emulated): the key trunk sees a permutation of the
    batch, so its BatchNorm groups mix the images of several queries, and each key comes back to its own query's row."""
    torch.manual_seed(0)
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=True, split_bn=2), knn_k=0)
    images, seen = torch.randn(16, 3, 32, 32), []
    model.target_backbone.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].clone()))
    keys = model.target_embed(images)
    order = [next(row for row in range(16) if torch.equal(seen[0][position], images[row])) for position in range(16)]
    assert sorted(order) == list(range(16)) and order != list(range(16))
    torch.testing.assert_close(keys, F.normalize(model.target_encode(images[order]), dim=1)[torch.argsort(torch.tensor(order))])
    model.eval()  # per-image outputs: the keys are each image's own
    torch.testing.assert_close(model.target_embed(images), F.normalize(model.target_encode(images), dim=1))


def test_memory_bank_updates_only_the_given_indices_with_the_momentum_rule():
    bank = MemoryBank(size=10, dim=4)
    before = bank.entries.clone()
    indices = torch.tensor([7, 2])
    features = F.normalize(torch.randn(2, 4), dim=1)
    bank.update(indices, features, momentum=0.5)
    expected = F.normalize(0.5 * before[indices] + 0.5 * features, dim=1)
    torch.testing.assert_close(bank.entries[indices], expected)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[indices] = False
    assert torch.equal(bank.entries[untouched], before[untouched])


# ------------------------------------------------------------------ split BatchNorm and shuffling
def test_split_batchnorm_normalises_each_interleaved_group_separately():
    split = SplitBatchNorm2d(3, num_splits=4)
    x = torch.randn(8, 3, 5, 5) * 3 + 1
    out = split(x)
    for group in range(4):
        members = x[group::4]
        mean = members.mean(dim=(0, 2, 3), keepdim=True)
        var = members.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        torch.testing.assert_close(out[group::4], (members - mean) / torch.sqrt(var + split.eps), atol=1e-5, rtol=1e-5)


def test_split_batchnorm_running_stats_average_the_groups_and_eval_is_plain_batchnorm():
    split, plain = SplitBatchNorm2d(3, num_splits=2), nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    split(x)
    group_means = torch.stack([x[g::2].mean(dim=(0, 2, 3)) for g in range(2)])
    torch.testing.assert_close(split.running_mean, 0.1 * group_means.mean(0))
    group_variances = torch.stack([x[g::2].var(dim=(0, 2, 3), unbiased=True) for g in range(2)])  # as BatchNorm's running_var
    torch.testing.assert_close(split.running_var, 0.9 + 0.1 * group_variances.mean(0))
    plain.load_state_dict(split.state_dict())
    split.eval(), plain.eval()
    torch.testing.assert_close(split(x), plain(x))


def test_split_batchnorm_returns_a_channels_last_input_in_channels_last_with_the_bits_of_an_nchw_input():
    """A channels-last trunk stays channels-last after its split BatchNorm (its max-pool and convolutions would
    otherwise run on NCHW), and the normalisation itself is the NCHW one: the same bits either way."""
    x = torch.randn(16, 5, 6, 7) * 2 + 1
    nchw, channels_last = SplitBatchNorm2d(5, num_splits=4), SplitBatchNorm2d(5, num_splits=4)
    out, reference = channels_last(x.contiguous(memory_format=torch.channels_last)), nchw(x)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert reference.is_contiguous() and torch.equal(out, reference)
    assert torch.equal(channels_last.running_var, nchw.running_var)


def test_a_batchnorm_subclass_that_split_bn_cannot_split_is_refused_naming_it():
    """timm's BatchNormAct2d (EfficientNet, RegNet) was left whole: the keys' statistics were the full batch's."""
    from timm.layers import BatchNormAct2d

    trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4), BatchNormAct2d(4)))
    with pytest.raises(ValueError, match=r"^momentum.split_bn 4: the trunk's 1.1 is a BatchNormAct2d, which cannot be split"):
        convert_to_split_batchnorm(trunk, 4)


def test_split_batchnorm_refuses_a_batch_that_does_not_divide():
    with pytest.raises(ValueError, match="divisible by 4"):
        SplitBatchNorm2d(3, num_splits=4)(torch.randn(6, 3, 2, 2))


def test_conversion_splits_only_batchnorm2d_and_keeps_its_state():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(2.0)
    converted = convert_to_split_batchnorm(model, 8)
    assert isinstance(converted[1], SplitBatchNorm2d) and converted[1].num_splits == 8
    assert torch.equal(converted[1].running_mean, torch.full((4,), 2.0))
    assert type(converted[3]) is nn.BatchNorm1d


def _shuffle_worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    local = torch.arange(4, dtype=torch.float32).view(4, 1) + 10 * rank
    seen = []

    def encoder(images):
        seen.append(images.clone())
        return images * 2

    output = distributed_shuffled_forward(encoder, local)
    results[rank] = (output, seen[0])
    dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_shuffle_bn_encodes_a_mixed_batch_and_returns_each_rank_its_own_keys():
    with mp.Manager() as manager:
        results = manager.dict()
        start_processes(_shuffle_worker, (2, free_port(), results))
        results = dict(results)
    everything = torch.cat([results[rank][1] for rank in (0, 1)]).flatten().sort().values
    assert everything.tolist() == [0.0, 1, 2, 3, 10, 11, 12, 13]  # one permutation shared by both ranks
    for rank in (0, 1):
        torch.testing.assert_close(results[rank][0], 2 * (torch.arange(4.0).view(4, 1) + 10 * rank))
    assert results[0][1].flatten().tolist() != [0.0, 1, 2, 3]  # rank 0 did not just encode its own batch


def test_split_batchnorm_gives_the_same_result_on_channels_last_input():
    split = SplitBatchNorm2d(3, num_splits=2)
    x = torch.randn(4, 3, 5, 5)
    expected = split(x)
    torch.testing.assert_close(split(x.contiguous(memory_format=torch.channels_last)), expected)


@pytest.mark.parametrize("split_bn", [1, 2])
def test_split_batchnorm_under_sync_batchnorm_is_refused_naming_both(split_bn):
    """`trainer.sync_batchnorm` replaces every BatchNorm by SyncBatchNorm (torch's conversion, which Lightning
    applies before `on_fit_start`): the split groups would silently become the whole global batch."""
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=split_bn > 1, split_bn=split_bn), knn_k=0)
    nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if split_bn == 1:
        model.on_fit_start()  # SCE's ImageNet recipe: SyncBN, no shuffle
    else:
        with pytest.raises(ValueError, match="momentum.split_bn=2 .* trainer.sync_batchnorm=true"):
            model.on_fit_start()


@pytest.mark.parametrize("shuffle_bn, split_bn, warned", [(True, 1, True), (True, 8, False), (False, 1, False)])
def test_shuffle_bn_in_one_process_without_split_bn_is_a_warning_naming_both_settings(shuffle_bn, split_bn, warned, recwarn):
    """A multi-GPU config run on one device would encode its keys unshuffled, with BatchNorm statistics of the
    batch they are compared in (MoCo, Sec. 3.3), and nothing would say so."""
    MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=shuffle_bn, split_bn=split_bn), knn_k=0).on_fit_start()
    messages = [str(warning.message) for warning in recwarn if "shuffle_bn" in str(warning.message)]
    assert len(messages) == warned
    assert all("momentum.shuffle_bn is true" in message and "momentum.split_bn N > 1" in message for message in messages)


def test_a_method_that_never_calls_init_momentum_is_one_error_line_before_training():
    class Forgetful(MomentumMixin, PretrainMethod):
        views = ("first", "second")

    model = Forgetful(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0)
    with pytest.raises(ValueError, match=r"^Forgetful has no momentum encoder: its __init__ must call self.init_momentum\(momentum\) after building the modules it copies$"):
        model.check_data(SimpleNamespace(batch_size=8), world_size=1)


def test_a_momentum_encoder_without_its_trunk_is_refused_where_a_momentum_trunk_is_needed():
    """A method whose EMA copy leaves out the trunk: split-BN and an evaluated momentum encoder read target_backbone
    (an AttributeError traceback at the first step or validation, after the run directory was made)."""

    class HeadOnly(MomentumMixin, PretrainMethod):
        views = ("first", "second")
        momentum_modules = ("projector",)

        def __init__(self, momentum: MomentumSpec, **kwargs):
            super().__init__(**kwargs)
            self.init_momentum(momentum)

    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0)
    with pytest.raises(ValueError, match=r"^HeadOnly: momentum.split_bn 2 needs a momentum trunk, but momentum_modules \['projector'\] has no 'backbone'$"):
        HeadOnly(MomentumSpec(split_bn=2), **options)
    HeadOnly.evaluated_encoder = "momentum"
    with pytest.raises(ValueError, match=r"^HeadOnly: evaluated_encoder 'momentum' needs a momentum trunk"):
        HeadOnly(MomentumSpec(split_bn=1), **options)
    HeadOnly.evaluated_encoder = "online"
    assert not hasattr(HeadOnly(MomentumSpec(split_bn=1), **options), "target_backbone")  # otherwise it may leave the trunk out
