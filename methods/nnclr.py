"""NNCLR: Nearest-Neighbor Contrastive Learning (Dwibedi et al., ICCV 2021).

SimCLR's contrast with a nearest neighbour instead of the other view as the positive: each view's projection
z is replaced by its nearest neighbour NN(z, Q) in a support set Q, a FIFO queue of past projections, and
contrasted with the predictions p+ of the other view of the global batch (paper Eq. 2, with the predictor of
section 3.2). NNCLR has no official code: the loss and the queue follow vturrisi/solo-learn
(solo/methods/nnclr.py, solo/losses/nnclr.py): one direction per view pair, the two pairs averaged; the
predictions gathered from every process with their gradients; the support set filled, after the loss, with
the normalised projections of the first view of every process. lightly (lightly/models/modules/
nn_memory_bank.py, lightly/loss/ntx_ent_loss.py) keeps a per-process support set and a two-direction NT-Xent
with same-view negatives instead.

Multi-crop (not in solo-learn's NNCLR, which takes two crops): each local crop's predictions are contrasted with the
nearest neighbours of both global views' projections; the loss is the mean over every (global view's neighbour, other
crop) pair, the two pairs' mean extended; the support set receives the first view's projections only.
"""

from backbones import MLPSpec
from engine.config import as_spec
from methods.losses import check_hyperparameters, nnclr_loss
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue


class NNCLR(PretrainMethod):
    views = ("first", "second")
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.1,
        queue_size: int = 98304,
        predictor: MLPSpec = MLPSpec(hidden_dim=4096, output_dim=256),
        **kwargs,
    ):
        """
        Args:
            temperature: tau (0.1 in the paper; solo-learn's configs 0.2, lightly's 0.5).
            queue_size: size of the support set Q (98,304 in the paper; solo-learn 65,536).
            predictor: the MLP after the projector (paper section 4: 4096 hidden with BN and ReLU, 256 out).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature)
        super().__init__(**kwargs)
        self.temperature = temperature
        self.predictor = as_spec(MLPSpec, predictor).build(self.projection_dim)
        self.support_set = KeyQueue(queue_size, self.projection_dim)

    def step(self, batch):
        crops = self.crops(batch["views"], self.views + self.local_crops)
        outputs, features = self.encode_crops(crops, self.backbone, self.project_and_predict, len(self.views))
        (projection1, _), (projection2, _) = outputs[:2]
        support = self.support_set.read()  # the neighbours come from the queue before this step's projections
        offset = self.global_rank * len(projection1)  # this process's rows in the gathered predictions
        predictions = [self.gather_with_grad(prediction) for _, prediction in outputs]
        total = nnclr_loss(projection1, predictions[1], support, self.temperature, offset) + nnclr_loss(projection2, predictions[0], support, self.temperature, offset)
        for gathered in predictions[2:]:
            total = total + nnclr_loss(projection1, gathered, support, self.temperature, offset) + nnclr_loss(projection2, gathered, support, self.temperature, offset)
        self.support_set.push(self.gather(projection1))
        return total / (2 * (len(outputs) - 1)), features
