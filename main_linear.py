"""Linear evaluation of a pretrained trunk (frozen, eval mode), the second stage.

    python main_linear.py fit --config configs/linear_digits.yaml --model.pretrained_ckpt runs/moco_digits/checkpoints/last.ckpt

The pretraining checkpoint is `--model.pretrained_ckpt`, not `--ckpt_path` (that one resumes a
linear run). The probe runs in the pretraining run's `linear/` folder (here `runs/moco_digits/linear/`)
unless `--trainer.default_root_dir` says otherwise.
"""

from engine.cli import ContrastlabCLI
from methods import LinearProbe


def cli_main(args=None) -> ContrastlabCLI:
    return ContrastlabCLI(LinearProbe, args=args)


if __name__ == "__main__":
    cli_main()
