"""JCL: Joint Contrastive Learning with infinite possibilities (Cai et al., NeurIPS 2020),
as in caiqi/Joint-Contrastive-Learning (`moco/moco_unlimit_key_default.py`).

MoCo v2 with M' positive keys per query: the query view goes through the online encoder, the M' key
views (one data view `keys` with `count: M'`, delivered as (B, M', C, H, W)) through the momentum
encoder in one batched forward with shuffle-BN (JCL supplementary, Sec. 3: "concatenating N x M'
positive keys in the batch dimension"). The keys of image i are summarised by their mean mu_i and
biased covariance Sigma_i, and the loss is the closed-form bound of infinitely many positive pairs
(JCL supplementary, Eq. S.3):
log[exp(q.mu/tau + lambda/(2 tau^2) q'Sigma q) + sum_j exp(q.n_j/tau)] - q.mu/tau, in
`methods.losses.jcl_loss`. The queue receives the mean keys mu, not re-normalised (official code).

Multi-crop (not in JCL's code): the local crops are further queries of the online encoder against the same keys and
queue; the loss is the mean over the queries, as MoCo's (juliendenize/eztorch shuffle_momentum_queue_base.py).
"""

import torch

from engine.config import RampSpec, as_spec
from methods.losses import check_hyperparameters, jcl_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue


class JCL(MomentumMixin, PretrainMethod):
    views = ("query", "keys")
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.2,
        jcl_lambda: float = 4.0,
        lambda_ramp: RampSpec | None = None,
        queue_size: int = 65536,
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        **kwargs,
    ):
        """
        Args:
            temperature: tau (0.2 in every JCL setting).
            jcl_lambda: lambda of Eq. S.3, the weight of the key covariance (2.0 in the official
                ImageNet script, 4.0 in the ImageNet-100 ablations of JCL supplementary, Table 1; the
                paper's lambda may be in the first code version's units, 1/tau times this one:
                caiqi/Joint-Contrastive-Learning).
            lambda_ramp: the official code's linear per-epoch ramp lambda_t = jcl_lambda (epoch + 1) / E
                is `{start: jcl_lambda / E, epochs: E - 1, unit: epoch}` for E > 1 training epochs (E = 1: lambda
                itself, no ramp); None keeps lambda constant (the paper's formula).
            queue_size: K, mean keys kept from previous steps (65,536 on ImageNet).
            momentum: EMA momentum of the key encoder (0.999, constant) and shuffle-BN settings.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature, jcl_lambda=jcl_lambda)
        super().__init__(**kwargs)
        self.temperature, self.jcl_lambda = temperature, jcl_lambda
        self.lambda_ramp = lambda_ramp and as_spec(RampSpec, lambda_ramp)
        if self.lambda_ramp:  # a ramp's values are lambda's, from its start on
            check_hyperparameters("model.lambda_ramp.start as ", jcl_lambda=self.lambda_ramp.start)
        self.init_momentum(momentum)
        self.queue = KeyQueue(queue_size, self.projection_dim)

    def scheduled_lambda(self) -> float:
        """lambda at the current epoch, after the optional ramp."""
        return self.lambda_ramp.value_at(self.jcl_lambda, self.epochs_done) if self.lambda_ramp else self.jcl_lambda

    def embed_keys(self, key_views: torch.Tensor) -> torch.Tensor:
        """(B, M', C, H, W) key views -> (B, M', D) normalised keys, in one momentum-encoder forward
        (no gradient), so the cost of M' keys is M' forwards and no backward (JCL supplementary, Sec. 2)."""
        if key_views.ndim == 4:  # `count: 1` delivers (B, C, H, W)
            key_views = key_views[:, None]
        return self.target_embed(key_views.flatten(0, 1)).unflatten(0, key_views.shape[:2])

    def step(self, batch):
        views = batch["views"]
        queries, features = self.embed_crops(views, ("query", *self.local_crops))
        keys = self.embed_keys(views["keys"])
        lam = self.scheduled_lambda()
        # Eq. S.3 with mu_i and the biased (1/M') Sigma_i of the M' keys of image i (JCL's moco/moco_unlimit_key_default.py)
        queue = self.queue.read()
        loss = torch.stack([jcl_loss(query, keys, queue, self.temperature, lam) for query in queries]).mean()
        self.queue.push(self.gather(keys.mean(dim=1)))  # mu_i, not re-normalised (official code, JCL supplementary, Sec. 3)
        # Mean diagonal of Sigma_i, tracked in training: the per-image key spread of JCL's Fig. 3(b)
        # (the main paper's figure; JCL supplementary, Sec. 5 says how it was made).
        key_variance = keys.float().var(dim=1, unbiased=False).mean()
        self.log_dict({"train/jcl_lambda": lam, "train/key_variance": key_variance}, on_step=True, on_epoch=False)
        return loss, features
