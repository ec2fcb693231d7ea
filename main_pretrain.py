"""Pretraining entry point.

    python main_pretrain.py fit --config configs/moco_digits.yaml
    python main_pretrain.py fit --config configs/sce_imagenet100.yaml --trainer.devices 4
    python main_pretrain.py fit --config configs/moco_cifar10.yaml --print_config
"""

from methods import MethodBase
from methods.cli import ContrastlabCLI


def cli_main(args=None) -> ContrastlabCLI:
    return ContrastlabCLI(MethodBase, args=args)


if __name__ == "__main__":
    cli_main()
