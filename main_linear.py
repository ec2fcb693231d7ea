"""Linear evaluation of a pretrained trunk (frozen, eval mode), the second stage; or fine-tuning of the whole trunk
with a linear head on a label fraction (`methods.FineTune`, configs `finetune_*.yaml`).

    python main_linear.py fit --config configs/linear_digits.yaml --model.pretrained_ckpt runs/moco_digits/checkpoints/last.ckpt
    python main_linear.py fit --config configs/finetune_digits_10pct.yaml --model.pretrained_ckpt runs/moco_digits/checkpoints/last.ckpt

The pretraining checkpoint is `--model.pretrained_ckpt`, not `--ckpt_path` (that one resumes a
linear run). The probe runs in the pretraining run's `linear/` folder (here `runs/moco_digits/linear/`), a
fine-tuning in its `finetune/` folder, unless `--trainer.default_root_dir` says otherwise.
"""

from engine.cli import ContrastlabCLI
from methods import LinearProbe


def cli_main(args=None) -> ContrastlabCLI:
    return ContrastlabCLI(LinearProbe, args=args)


if __name__ == "__main__":
    cli_main()
