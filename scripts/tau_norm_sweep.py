"""Choose the tau of Kang et al.'s tau-normalised classifier (ICLR 2020) on the validation split, as their code does.

    uv run python scripts/tau_norm_sweep.py runs/tau_norm_imagenet_lt/checkpoints/last.ckpt --config configs/tau_norm_imagenet_lt.yaml

facebookresearch/classifier-balancing tau_norm.py evaluates the classifier w_k / ||w_k||^p without its bias for p in
numpy.linspace(0, 2, 21) (the default `--tau` here) and keeps the p of the best validation accuracy. This takes one
extraction of the trunk's features of the split (the evaluation view, eval mode, fp32, as `validate` classifies), and
gives for each tau the top-1 and the shot groups that `main_pretrain.py validate --model.init_args.tau_norm TAU` gives
(tau 0 here is their p = 0 row, the weights without the bias; the model's `tau_norm: 0` keeps the bias). It prints a
line per tau and the chosen one (the first of the best top-1), and writes OUT/tau_norm.json (OUT:
`<run>/analysis/<checkpoint>-<split>` unless `--out` says otherwise). Then test the chosen tau:
`main_pretrain.py test --config CONFIG --ckpt_path CKPT --model.init_args.tau_norm TAU`. Overrides of the config
(its data) come after `--`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the repository

from analysis.loading import default_out, measured_on, usable_device  # noqa: E402
from analysis.representation import eval_batches, eval_mode, split_dataset  # noqa: E402
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.cli import instantiate_config  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from engine.files import WriteFailed, read_checkpoint, write_atomically  # noqa: E402
from methods.checkpoints import require_method  # noqa: E402
from methods.evaluation import shot_accuracies  # noqa: E402
from methods.longtail import CrossEntropy, tau_normalised  # noqa: E402

KANG_TAUS = [round(float(tau), 1) for tau in np.linspace(0, 2, 21)]  # classifier-balancing tau_norm.py


@torch.no_grad()
def tau_sweep(model: CrossEntropy, datamodule, taus: list[float], split: str = "val") -> list[dict]:
    """`{"tau", "top1", "many_top1", ...}` per tau, in the order of `taus` (module docstring)."""
    trained_counts = model.class_counts.clone()
    model.check_data(datamodule, 1)  # the data's checks; it sets the class counts from the data's training split
    if trained_counts.any():  # the shot groups of the counts the model was trained on, as `validate` restores them
        model.class_counts.copy_(trained_counts)
    classifiers, classes = [tau_normalised(model.classifier.weight.float(), tau) for tau in taus], model.num_classes
    correct, seen = torch.zeros(len(taus), classes, dtype=torch.long), torch.zeros(classes, dtype=torch.long)
    with eval_mode(model), torch.autocast(model.device.type, enabled=False):
        for batch in eval_batches(datamodule, split_dataset(datamodule, split)):
            features, labels = model.backbone(batch["image"].to(model.device).float()), batch["label"].to(model.device)
            seen += torch.bincount(labels, minlength=classes).cpu()
            for row, weight in enumerate(classifiers):
                hits = labels[(features @ weight.T).argmax(dim=1) == labels]
                correct[row] += torch.bincount(hits, minlength=classes).cpu()
    zeros = torch.zeros(classes, dtype=torch.long)  # the stat scores' fp, tn, fn: shot_accuracies reads tp and support
    many_above, few_below = model.shot_bounds
    return [{"tau": tau} | shot_accuracies(torch.stack([correct[row], zeros, zeros, zeros, seen], dim=1), model.class_counts.cpu(), many_above, few_below)
            for row, tau in enumerate(taus)]


def non_negative_float(text: str) -> float:
    """An argparse type: a tau (argparse's one error line names the option and the value)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):  # inf: every logit 0, and JSON has no Infinity
        raise ValueError(text)
    return value


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="scripts/tau_norm_sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a main_pretrain.py checkpoint of methods.CrossEntropy")
    parser.add_argument("--config", required=True, help="its config (for the data)")
    parser.add_argument("--split", default="val", help="the DataModule split tau is chosen on")
    parser.add_argument("--tau", type=non_negative_float, nargs="+", default=KANG_TAUS, help="the taus to evaluate")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/analysis/<checkpoint>-<split>)")
    parser.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(own)
    source = f"checkpoint {str(args.checkpoint)!r}"
    try:
        out = default_out(args)
        if model_overrides := [argument for argument in overrides if argument.startswith("--model")]:
            raise ValueError(f"{model_overrides[0]}: the sweep evaluates the classifier the checkpoint holds; give data overrides only")
        checkpoint = read_checkpoint(args.checkpoint, source)
        require_method(checkpoint, source, CrossEntropy, "sweep tau over a cross-entropy classifier (methods.CrossEntropy)")
        datamodule = instantiate_config(args.config, overrides).datamodule
        model = CrossEntropy.load_from_checkpoint(args.checkpoint, map_location=args.device)
        settings = tau_sweep(model, datamodule, args.tau, args.split)
        chosen = max(settings, key=lambda setting: setting["top1"])  # the first of equal ones
        record = {**measured_on(args, overrides, "contrastlab", datamodule), "split": args.split, "chosen_tau": chosen["tau"], "settings": settings}
        write_atomically(out / "tau_norm.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    for setting in settings:
        groups = "  ".join(f"{name} {100 * setting[f'{name}_top1']:.2f}%" for name in ("many", "medium", "few") if f"{name}_top1" in setting)
        print(f"tau {setting['tau']:<5}  top-1 {100 * setting['top1']:.2f}%  {groups}")
    print(f"chosen: tau {chosen['tau']} (top-1 {100 * chosen['top1']:.2f}% on {args.split}); written: {out / 'tau_norm.json'}")
    if chosen["tau"] == 0 and (positive := [setting for setting in settings if setting["tau"] > 0]):
        best = max(positive, key=lambda setting: setting["top1"])
        print(f"tau 0 is the classifier without its bias, which no model.init_args.tau_norm gives (0 keeps the bias): "
              f"the best tau that `test` can evaluate is {best['tau']} (top-1 {100 * best['top1']:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
