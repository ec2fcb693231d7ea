"""The loss library: the losses of the reproduced papers and their baselines, as pure functions of tensors.

Conventions shared by every function:

- embeddings are already L2-normalised rows (Barlow Twins and VICReg take the projector's raw output); a queue or
  memory bank is a ``(K, D)`` tensor, one key per row; the crops of multi-crop losses come stacked, crop-major
  ``(V, B, K)`` (SwAV, DINO) or sample-major ``(B, V, D)`` (SupCon, TCL, SimCLR's multi-crop NT-Xent, as SupContrast's);
- each loss returns a 0-d tensor, the mean of its per-anchor losses where it has anchors;
- the math runs with autocast disabled, in float32, or in float64 when any input is float64 (so that
  ``torch.autograd.gradcheck`` works); only logsumexp / log-softmax forms are used, never ``exp`` then ``log``;
- nothing is updated: queues, banks and momentum encoders belong to the caller;
- gradients reach every input that requires them, except the SCE and ReSSL target distributions, BYOL's targets,
  SimSiam's projections, NNCLR's nearest neighbours, SwAV's codes and DINO's teacher, which are detached as in the
  official code;
- bad input raises ``ValueError`` naming the offending argument.

The library is one module per family of losses: `contrastive` (InfoNCE, NT-Xent, Wang & Liu / NPID, JCL, MoCo v3,
NNCLR), `predictive` (BYOL, SimSiam), `relational` (ReSSL, SCE), `supervised` (SupCon, TCL, PaCo), `redundancy`
(Barlow Twins, VICReg), `clustering` (SwAV's Sinkhorn-Knopp and swapped prediction, DINO); `common` holds what they
share, among it the domain of every scalar hyper-parameter (`check_hyperparameters`). Import the losses from here:
`from methods.losses import info_nce`.
"""

from methods.losses.common import HYPERPARAMETER_DOMAINS, check_hyperparameters
from methods.losses.contrastive import contrastive_loss, info_nce, jcl_loss, mocov3_loss, nnclr_loss, nt_xent
from methods.losses.predictive import byol_loss, simsiam_loss
from methods.losses.relational import ressl_loss, sce_loss
from methods.losses.supervised import nt_xent_multi_crop, paco_loss, supcon_loss, tcl_loss
from methods.losses.redundancy import barlow_twins_loss, vicreg_loss
from methods.losses.clustering import dino_loss, sinkhorn_knopp, swav_loss

__all__ = [
    "HYPERPARAMETER_DOMAINS",
    "byol_loss",
    "check_hyperparameters",
    "contrastive_loss",
    "info_nce",
    "jcl_loss",
    "mocov3_loss",
    "nnclr_loss",
    "nt_xent",
    "nt_xent_multi_crop",
    "paco_loss",
    "ressl_loss",
    "sce_loss",
    "simsiam_loss",
    "supcon_loss",
    "tcl_loss",
    "barlow_twins_loss",
    "vicreg_loss",
    "dino_loss",
    "sinkhorn_knopp",
    "swav_loss",
]
