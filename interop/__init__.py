"""Trunks in and out of contrastlab.

- `interop.export` (`python -m interop.export --help`): a pretraining or long-tail checkpoint as a plain
  torchvision / timm state dict (`.pth` and `.safetensors`, the classifier included for the long-tail
  methods) or as detectron2 weights (`.pkl`, the renaming of MoCo's `convert-pretrain-to-detectron2.py`),
  with a JSON record of where it came from.
- `interop.official`: the official checkpoints of MoCo, JCL, SCE, PaCo, SupContrast, NPID (WangFeng18) and
  torchvision / timm weights, read into contrastlab's names for the linear stage and kNN
  (`main_linear.py --model.pretrained_ckpt FILE --model.pretrained_format moco`), `validate` of the
  long-tail classifiers (`--model.init_args.pretrained_ckpt`) and the analysis (`python -m analysis FILE --format moco`).
"""

from interop.official import FORMATS, load_official_classifier, load_official_encoder, official_trunk

__all__ = ["FORMATS", "load_official_classifier", "load_official_encoder", "official_trunk"]
