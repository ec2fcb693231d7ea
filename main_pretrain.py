"""Pretraining entry point.

    python main_pretrain.py fit --config configs/moco_digits.yaml
    python main_pretrain.py fit --config configs/sce_imagenet100.yaml --trainer.devices 4
    python main_pretrain.py fit --config configs/moco_cifar10.yaml --print_config
    python main_pretrain.py fit --config configs/moco_digits.yaml --ckpt_path last  # resume, or start if there is no run

A `fit` in a `trainer.default_root_dir` that already holds a run (`checkpoints/last.ckpt`) is refused
unless it resumes it; on SIGTERM the run saves its current step as `last.ckpt` and exits with 143.
"""

from engine.cli import ContrastlabCLI
from methods import MethodBase


def cli_main(args=None) -> ContrastlabCLI:
    return ContrastlabCLI(MethodBase, args=args)


if __name__ == "__main__":
    cli_main()
