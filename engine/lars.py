"""LARS: SGD with momentum and layer-wise adaptive rate scaling, the optimizer of SCE's, BYOL's and SimSiam's
large-batch ImageNet runs (`engine.optim.build_optimizer`, `optimizer.name: lars`)."""

import torch
from torch.optim import Optimizer


class LARS(Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al. 2017), by default in the form used
    by SCE/BYOL: for a group without `lars_exclude`, the update g + wd * p is rescaled by
    trust_coefficient * ||p|| / ||g + wd * p|| (1 where a norm is 0); excluded groups are plain SGD.
    `trust_denominator="norm_sum"` and `clip_lr=True` give solo-learn's form, `lr_in_momentum=True`
    google-research/simclr's (OptimizerSpec)."""

    def __init__(
        self, params, lr: float, momentum: float = 0.9, trust_coefficient: float = 0.001,
        trust_denominator: str = "update_norm", clip_lr: bool = False, lr_in_momentum: bool = False,
    ):
        if trust_denominator not in ("update_norm", "norm_sum"):
            raise ValueError(f"optimizer.lars_trust_denominator must be 'update_norm' or 'norm_sum', got {trust_denominator!r}")
        defaults = dict(lr=lr, momentum=momentum, trust_coefficient=trust_coefficient, weight_decay=0.0,
                        trust_denominator=trust_denominator, clip_lr=clip_lr, lr_in_momentum=lr_in_momentum)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # every operation on all of a group's tensors at once (multi-tensor)
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            updates = torch._foreach_add([param.grad for param in params], params, alpha=group["weight_decay"])
            lr_in_momentum = group.get("lr_in_momentum", False)  # absent from the optimizer state of older checkpoints
            trust = None
            if not group.get("lars_exclude", False):
                param_norms = torch.stack(torch._foreach_norm(params))
                if group["trust_denominator"] == "norm_sum":  # solo-learn: its eps 1e-8 included
                    grad_norms = torch.stack(torch._foreach_norm([param.grad for param in params]))
                    denominators, defined = grad_norms + group["weight_decay"] * param_norms + 1e-8, grad_norms > 0
                else:
                    denominators = torch.stack(torch._foreach_norm(updates))
                    defined = denominators > 0
                ratio = group["trust_coefficient"] * param_norms / denominators
                if group["clip_lr"]:
                    ratio = (ratio / group["lr"]).clamp(max=1.0)
                trust = torch.where((param_norms > 0) & defined, ratio, torch.ones_like(ratio))
                if group["trust_denominator"] == "norm_sum":  # solo-learn adds no weight decay to a zero gradient (solo/utils/lars.py)
                    trust = torch.where(grad_norms > 0, trust, torch.zeros_like(trust))
            if lr_in_momentum:  # the step lr x trust, as one factor (simclr's scaled_lr), enters the momentum
                torch._foreach_mul_(updates, list((group["lr"] * trust).unbind()) if trust is not None else group["lr"])
            elif trust is not None:
                torch._foreach_mul_(updates, list(trust.unbind()))
            buffers = [self.state[param].setdefault("momentum_buffer", torch.zeros_like(param)) for param in params]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, updates)
            if lr_in_momentum:
                torch._foreach_sub_(params, buffers)
            else:
                torch._foreach_add_(params, buffers, alpha=-group["lr"])
        return loss
