"""Checkpoints as the papers' official code writes them: where each part lives, under which names.

Every layout below is read from the repository's own model definition and its load or convert code:

| format | file | trunk | head(s) | classifier |
|---|---|---|---|---|
| `moco` | facebookresearch/moco `main_moco.py`: `{"state_dict", "arch", "epoch", "optimizer"}` | `module.encoder_q.*` without `fc.*` (`main_lincls.py` keeps exactly these) | `module.encoder_q.fc.*` (`moco/builder.py`: the MLP replaces `fc`) | - |
| `jcl` | caiqi/Joint-Contrastive-Learning: MoCo's layout (`moco/moco_unlimit_key_default.py`, `main_lincls.py`) | as `moco` | as `moco` | - |
| `sce` | CEA-LIST/SCE: a Lightning checkpoint, `state_dict` | `trunk.*` (`utils/checkpoints.py`: the linear evaluation takes `^trunk\\.`; torchvision ResNet, `fc` an Identity) | `projector.layers.*`, `predictor.layers.*` (`models/heads/mlp.py`) | - |
| `paco` | dvlab-research/Parametric-Contrastive-Learning `PaCo/LT/paco_lt.py`: `{"state_dict", "arch", "epoch", "acc", "optimizer"}` | `module.encoder_q.*` without `fc.*` (`moco/builder.py`) | `module.encoder_q.fc.*` | the centres `module.linear.*` (`_inference`: `linear` on the pooled `encoder_q` feature) |
| `supcon` | HobbitLong/SupContrast `util.py` `save_model`: `{"model", "opt", "optimizer", "epoch"}` | `encoder.*`, or `encoder.module.*` after `main_supcon.py`'s DataParallel; blocks name their projection shortcut `shortcut` (`networks/resnet_big.py`), torchvision `downsample` | `head.*` | - |
| `npid` | WangFeng18/UnsupervisedLearningCodes `main.py` / `run.py`: `{"state_dict", "optimizer", "epoch", "memory_banks", "neigh"}`, the network wrapped in DataParallel | `module.*` without the head; CIFAR nets (`models/resnet_cifar.py`) name the shortcut `shortcut` | `module.linear.*` (CIFAR) or `module.fc.*` (`models/resnet.py`) | - |
| `swav` | facebookresearch/swav `*_pretrain.pth.tar` releases: a flat state dict of the DDP model (`hubconf.py` strips `module.` and loads it into torchvision's resnet50 non-strictly) | `module.*` without the head and prototypes (`src/resnet50.py`: torchvision's names; its `ConstantPad2d(1)` + padding-2 stem computes torchvision's) | - (`module.projection_head.*` has a bias before its BN, which contrastlab's SwAV head leaves out) | - |
| `dino` | facebookresearch/dino `main_dino.py` `checkpoint.pth`: `{"student", "teacher", "optimizer", "epoch", "args", "dino_loss"}`; the teacher is read, as `eval_linear.py` (`checkpoint_key="teacher"`) | `teacher`'s `backbone.*` (a ViT teacher is not DDP-wrapped; timm's ViT names) or `module.backbone.*` (ResNet, DDP for its BN) | `head.mlp.*` (`vision_transformer.py` DINOHead: GELU MLP, contrastlab's `projector`) | - |
| `torchvision` | a plain state dict (`torch.save(model.state_dict())`, or `.safetensors`) | every key but `fc.*` | - | `fc.*` |
| `timm` | a plain state dict of `timm.create_model(name)` | every key but the classifier's | - | the model's `pretrained_cfg["classifier"]` |
| `mocov3` | facebookresearch/moco-v3 `main_moco.py`: `{"epoch", "arch", "state_dict", "optimizer", "scaler"}` | `module.base_encoder.*` without `fc.*` (ResNet) or `head.*` (ViT) (`main_lincls.py` keeps exactly these) | `module.base_encoder.fc.*` / `.head.*` (`moco/builder.py`: the projector replaces the classifier), `module.predictor.*` | - |
| `simsiam` | facebookresearch/simsiam `main_simsiam.py`: `{"epoch", "arch", "state_dict", "optimizer"}` | `module.encoder.*` without `fc.*` (`main_lincls.py` keeps exactly these) | `module.encoder.fc.*` (`simsiam/builder.py`: the projector ends with the ResNet's own fc), `module.predictor.*` | - |
| `solo_learn` | vturrisi/solo-learn: a Lightning checkpoint, `state_dict`, no `hyper_parameters` (`main_pretrain.py`) | `backbone.*`, the online trunk, as its `main_linear.py` reads it for every method (`momentum_backbone.*` is not read); its CIFAR stem pads by 2 (`small_input_stem: solo_learn`) | - (the projectors differ per method) | - (`classifier.*` is its online linear layer) |

The architectures are torchvision's: SupContrast's and WangFeng18's CIFAR ResNets are torchvision's ResNet
with the small-input stem (3x3 stride-1 convolution, no max-pool; `backbones.build_backbone(..., small_input=True)`),
the same blocks under other names (WangFeng18's `avg_pool2d(out, 4)` is the global average at 32 px).
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from backbones import BACKBONE_NAMES, BackboneSpec, attention_heads, load_state_strictly
from backbones.vit import VIT_SIZES
from engine.checkpoint_record import RECORD_KEY
from engine.config import as_spec
from engine.files import is_state_dict, read_checkpoint

FORMATS = ("contrastlab", "moco", "sce", "paco", "supcon", "jcl", "npid", "torchvision", "timm", "mocov3", "simsiam", "swav", "dino", "solo_learn")
LIGHTNING_KEY = "pytorch-lightning_version"


@dataclass(frozen=True)
class Layout:
    """Where an official checkpoint keeps each part; prefixes are tried in order, the first present is used."""

    container: str | None  # the checkpoint entry that holds the state dict (None: the file is the state dict)
    trunk: tuple[str, ...]
    not_trunk: tuple[str, ...] = ()  # prefixes, after the trunk's, of keys that are a head or the classifier
    renames: tuple[tuple[str, str], ...] = ()  # to torchvision's module names
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # contrastlab head -> its prefixes
    classifier: tuple[str, ...] = ()


MOCO = Layout("state_dict", ("module.encoder_q.",), not_trunk=("fc.",), heads={"projector": ("module.encoder_q.fc.",)})
LAYOUTS = {
    "moco": MOCO,
    "jcl": MOCO,
    "sce": Layout("state_dict", ("trunk.",), heads={"projector": ("projector.layers.",), "predictor": ("predictor.layers.",)}),
    "paco": replace(MOCO, classifier=("module.linear.",)),
    "supcon": Layout("model", ("encoder.module.", "encoder."), renames=(("shortcut.", "downsample."),), heads={"projector": ("head.",)}),
    "npid": Layout(
        "state_dict", ("module.",), not_trunk=("linear.", "fc."), renames=(("shortcut.", "downsample."),),
        heads={"projector": ("module.linear.", "module.fc.")},
    ),  # fmt: skip
    "torchvision": Layout(None, ("",), not_trunk=("fc.",), classifier=("fc.",)),
    "mocov3": Layout(
        "state_dict", ("module.base_encoder.",), not_trunk=("fc.", "head."),
        heads={"projector": ("module.base_encoder.fc.", "module.base_encoder.head."), "predictor": ("module.predictor.",)},
    ),  # fmt: skip
    "simsiam": Layout("state_dict", ("module.encoder.",), not_trunk=("fc.",), heads={"projector": ("module.encoder.fc.",), "predictor": ("module.predictor.",)}),
    # Barlow Twins' and VICReg's released resnet50.pth are torchvision state dicts without `fc` (`torchvision`)
    "swav": Layout(None, ("module.",), not_trunk=("projection_head.", "prototypes.")),
    "dino": Layout("teacher", ("module.backbone.", "backbone."), heads={"projector": ("module.head.mlp.", "head.mlp.")}),
    # vturrisi/solo-learn: its main_linear.py reads the online `backbone.*` of every method (the momentum_backbone
    # of BYOL's or DINO's too); the projectors differ per method and are not read
    "solo_learn": Layout("state_dict", ("backbone.",)),
}
MOMENTUM_TRUNK_FORMATS = ("dino",)  # whose trunk read is the momentum copy (DINO's teacher, as eval_linear.py reads it)


@dataclass
class OfficialWeights:
    """An official checkpoint in contrastlab's names: the trunk as `backbones.build_backbone` builds it,
    the projection heads as `backbones.build_mlp` numbers its layers, the classifier as an `nn.Linear`."""

    format: str
    trunk: dict[str, torch.Tensor]
    heads: dict[str, dict[str, torch.Tensor]]
    classifier: dict[str, torch.Tensor] | None


def check_format(format: str | None, key: str) -> None:
    if format is not None and format not in FORMATS:
        raise ValueError(f"{key} {format!r} is not a known checkpoint format; choose one of {', '.join(FORMATS)}")


def detect_format(checkpoint: Any, backbone_name: str | None, source: str) -> str:
    """The layout of a loaded checkpoint, from its keys (JCL's is MoCo's: detected as `moco`)."""
    if is_state_dict(checkpoint):
        if any(key.startswith("module.prototypes.") for key in checkpoint):  # one head, or several (prototypes.prototypes<i>)
            return "swav"
        return "timm" if (backbone_name or "").startswith("timm:") else "torchvision"
    entries = checkpoint if isinstance(checkpoint, dict) else {}
    keys = entries.get("state_dict") if isinstance(entries.get("state_dict"), dict) else {}
    if any(key.startswith("backbone.") for key in keys):  # no official layout names its trunk `backbone` but solo-learn's
        # solo-learn's LightningModules save no hyperparameters, and name their online linear layer `classifier`
        solo_learn = "classifier.weight" in keys and "hyper_parameters" not in entries and RECORD_KEY not in entries
        return "solo_learn" if solo_learn else "contrastlab"
    if any(key.startswith("module.encoder_q.") for key in keys):
        return "paco" if "module.linear.weight" in keys else "moco"
    if any(key.startswith("module.base_encoder.") for key in keys):
        return "mocov3"
    if any(key.startswith("module.encoder.") for key in keys) and any(key.startswith("module.predictor.") for key in keys):
        return "simsiam"
    if LIGHTNING_KEY in entries and any(key.startswith("trunk.") for key in keys):
        return "sce"
    if any(key.startswith("module.prototypes.") for key in keys):  # SwAV's training checkpoint.pth.tar: its model under state_dict
        return "swav"
    if "module.conv1.weight" in keys:
        return "npid"
    if isinstance(entries.get("model"), dict) and any(key.startswith("encoder.") for key in entries["model"]):
        return "supcon"
    if isinstance(entries.get("teacher"), dict) and isinstance(entries.get("student"), dict):
        return "dino"
    found = list(keys or entries)[:5]
    raise ValueError(
        f"{source} is in no known format: it holds no 'backbone.*' weights (a contrastlab checkpoint) and none of the "
        f"official layouts (interop.official); its keys begin {found}: give its format, one of {', '.join(FORMATS)}"
    )


def layout_of(format: str, backbone_name: str | None, source: str) -> Layout:
    if format != "timm":
        return LAYOUTS[format]
    if backbone_name in VIT_SIZES:  # contrastlab's ViTs are timm's VisionTransformer (`interop.export --format timm`)
        return Layout(None, ("",), not_trunk=("head.",), classifier=("head.",))
    if not (backbone_name or "").startswith("timm:"):
        raise ValueError(
            f"{source} (format timm): give the timm trunk it holds as model.backbone (name 'timm:<model_name>', or "
            f"{', '.join(VIT_SIZES)} for a Vision Transformer that contrastlab exported)"
        )
    from timm.models import get_pretrained_cfg_value  # lazily: timm is only needed for timm trunks

    classifiers = get_pretrained_cfg_value(backbone_name.removeprefix("timm:"), "classifier") or ()
    prefixes = tuple(f"{name}." for name in ((classifiers,) if isinstance(classifiers, str) else classifiers))
    return Layout(None, ("",), not_trunk=prefixes, classifier=prefixes[:1])


def convert(checkpoint: Any, format: str, backbone_name: str | None, source: str) -> OfficialWeights:
    """The parts of a checkpoint in `format`, renamed to contrastlab's names (no tensor is changed)."""
    layout = layout_of(format, backbone_name, source)
    state = checkpoint if layout.container is None else (checkpoint.get(layout.container) if isinstance(checkpoint, dict) else None)
    if layout.container is None and not is_state_dict(state) and isinstance(checkpoint, dict) and is_state_dict(checkpoint.get("state_dict")):
        state = checkpoint["state_dict"]  # a training checkpoint of a flat layout ({"epoch", "state_dict", "optimizer"}: SwAV's)
    where = "" if layout.container is None else f" under {layout.container!r}"
    if not is_state_dict(state):
        raise ValueError(f"{source} (format {format}) holds no state dict{where}")
    prefix = next((prefix for prefix in layout.trunk if any(key.startswith(prefix) for key in state)), None)
    if prefix is None:
        raise ValueError(f"{source} (format {format}) holds no '{layout.trunk[0]}*' weights{where}; its keys begin {list(state)[:5]}")
    trunk = {}
    for key, value in state.items():
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and not name.startswith(layout.not_trunk):
            for old, new in layout.renames:
                name = name.replace(old, new)
            trunk[name] = value
    heads = {role: _as_sequential(_part(state, prefixes)) for role, prefixes in layout.heads.items()}
    return OfficialWeights(format, trunk, {role: head for role, head in heads.items() if head}, _part(state, layout.classifier) or None)


def _part(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    for prefix in prefixes:
        part = {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
        if part:
            return part
    return {}


def _as_sequential(head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A head that is one bare Linear (MoCo v1's `fc`, NPID's `linear`) is layer 0 of a one-layer MLP."""
    return {f"0.{key}": value for key, value in head.items()} if set(head) == {"weight", "bias"} else head


def export_record(path: str, source: str) -> dict | None:
    """The record `interop.export` writes beside its files (`<out>.json`) when it lists `path`, else None."""
    file = Path(path).expanduser()
    record_path = file.with_suffix(".json")
    if file.suffix not in (".pth", ".safetensors") or not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{source}: its export record {str(record_path)!r} is unreadable ({type(error).__name__}: {error})") from None
    return record if isinstance(record, dict) and file.name in record.get("files", []) else None  # else a JSON file of another kind


def exported_backbone(path: str, source: str) -> BackboneSpec | None:
    """The trunk that the record `interop.export` writes beside its files says `path` holds; None for a file no such
    record lists. Only the record knows a small-input stem's padding: SCE's 1 and solo-learn's 2 have the same
    weights, so `infer_backbone` would read solo-learn's as SCE's and probe other features."""
    record = export_record(path, source)
    if record is None:
        return None
    try:
        trunk = record["trunk"]
        stem = trunk.get("small_input_stem", "sce")  # the one stem before the key was recorded (7331032)
        return BackboneSpec(trunk["name"], small_input=trunk["small_input"], small_input_stem=stem, kwargs=trunk["kwargs"])
    except (KeyError, TypeError, AttributeError) as error:
        record_path = Path(path).expanduser().with_suffix(".json")
        raise ValueError(f"{source}: its export record {str(record_path)!r} is unreadable ({type(error).__name__}: {error})") from None


def infer_backbone(trunk: dict[str, torch.Tensor], source: str) -> BackboneSpec:
    """The torchvision ResNet/ResNeXt (either stem) or CIFAR ResNet whose names these weights carry, by
    torchvision's naming: depth from the blocks per stage (2 or 3 convolutions each), groups and width per
    group from the first 3x3 convolution. The strict load that follows checks every key and shape."""
    if "conv1.weight" not in trunk:
        raise ValueError(f"{source}: its trunk is not a ResNet (no 'conv1.weight'); give model.backbone")
    stages = [len({key.split(".")[1] for key in trunk if key.startswith(f"layer{stage}.")}) for stage in (1, 2, 3, 4)]
    bottleneck = "layer1.0.conv3.weight" in trunk
    stem_width, _, kernel, _ = trunk["conv1.weight"].shape
    if not bottleneck and stages[3] == 0:  # three stages, option-A shortcuts: LDAM-DRW's CIFAR ResNet
        spec = BackboneSpec(f"cifar_resnet{2 * sum(stages) + 2}", kwargs={} if stem_width == 16 else {"base_width": stem_width})
    else:
        depth = (3 if bottleneck else 2) * sum(stages) + 2
        width, width_per_group = trunk["layer1.0.conv2.weight"].shape[:2]
        groups = width // width_per_group
        name = f"resnet{depth}" if groups == 1 else f"resnext{depth}_{groups}x{width_per_group}d"
        spec = BackboneSpec(name, small_input=kernel == 3)
    if spec.name not in BACKBONE_NAMES:
        raise ValueError(
            f"{source}: its trunk ({'bottleneck' if bottleneck else 'basic'} blocks {stages}, read as {spec.name!r}) is "
            "no backbone contrastlab builds; give model.backbone"
        )
    return spec


# ----------------------------------------------------------------- what the stages call
def official_weights(checkpoint: Any, format: str | None, backbone_name: str | None, source: str) -> OfficialWeights | None:
    """A loaded official checkpoint in contrastlab's names, or None when it is a contrastlab checkpoint."""
    if format == "contrastlab":
        return None
    format = format or detect_format(checkpoint, backbone_name, source)
    return None if format == "contrastlab" else convert(checkpoint, format, backbone_name, source)


def official_trunk(
    checkpoint: Any, format: str | None, backbone: BackboneSpec | dict | None, source: str, encoder: str | None = None
) -> tuple[dict, BackboneSpec] | None:
    """The linear stage's trunk weights and spec (`backbone`, else inferred from the weights) from a loaded official
    checkpoint; None when it is a contrastlab checkpoint, which the linear stage reads itself. An `encoder` other than
    the one the format reads (None: that one) is refused, as it would probe another trunk than the one asked for:
    `momentum` for every format but DINO's (their official linear evaluations read the online trunk, which is the one
    read here: MoCo's, JCL's, PaCo's and MoCo v3's files also hold a momentum encoder, which is not read; an export holds
    the one trunk it was exported from), `online` for DINO's, whose teacher is read, as eval_linear.py reads it."""
    check_format(format, "model.pretrained_format")
    weights = official_weights(checkpoint, format, _name(backbone), source)
    if weights is None:
        return None
    if encoder == "momentum" and weights.format not in MOMENTUM_TRUNK_FORMATS:
        raise ValueError(f"{source} (format {weights.format}) is read as its online trunk, which its official linear evaluation probes (a momentum "
                         "encoder it may hold is not read): give --model.pretrained_encoder online")
    if encoder == "online" and weights.format in MOMENTUM_TRUNK_FORMATS:
        raise ValueError(f"{source} (format {weights.format}) is read as its teacher, the momentum trunk, as eval_linear.py reads it: give "
                         "--model.pretrained_encoder momentum, or leave it out")
    if backbone is not None:
        check_head_count(checkpoint, weights.format, as_spec(BackboneSpec, backbone), source)
        return weights.trunk, backbone
    spec = infer_backbone(weights.trunk, source)
    if weights.format == "solo_learn" and spec.small_input:  # its CIFAR stem pads by 2 (solo/methods/base.py), which no shape shows
        spec = replace(spec, small_input_stem="solo_learn")
    return weights.trunk, spec


# The head counts of the official ViTs a checkpoint names in its `arch` (moco-v3 main_moco.py) or `args.arch` (dino
# main_dino.py): moco-v3 vits.py gives its ViT-S 12 heads where DeiT's and DINO's (vision_transformer.py) have 6. The
# head count changes no tensor shape, so a strict load cannot tell.
OFFICIAL_VIT_HEADS = {("mocov3", "vit_small"): 12, ("mocov3", "vit_base"): 12, ("dino", "vit_tiny"): 3, ("dino", "vit_small"): 6, ("dino", "vit_base"): 12}


def check_head_count(checkpoint: Any, format: str, spec: BackboneSpec, source: str) -> None:
    """A ViT trunk given for an official checkpoint must have the heads of the architecture the checkpoint names."""
    if not isinstance(checkpoint, dict):
        return
    arch = checkpoint.get("arch") if format == "mocov3" else getattr(checkpoint.get("args"), "arch", None)
    expected = OFFICIAL_VIT_HEADS.get((format, arch)) if isinstance(arch, str) else None
    if expected is None:
        return
    given = attention_heads(spec)
    if given is not None and given != expected:
        raise ValueError(
            f"{source} is {format}'s {arch}, a ViT of {expected} heads; model.backbone {spec.name!r} builds {given}: give "
            f"model.backbone.kwargs.num_heads {expected} (the weights would load and be read as another network)"
        )


def load_official_classifier(trunk: torch.nn.Module, classifier: torch.nn.Module, path: str, format: str | None, backbone: BackboneSpec) -> float:
    """Load a long-tail classifier's trunk and classifier (PaCo's centres, a torchvision/timm `fc`) strictly; return the
    tau its classifier was normalised with when exported (`interop.export --tau-norm`, its record), else 0."""
    check_format(format, "model.pretrained_format")
    source = f"model.pretrained_ckpt {path!r}"
    weights = official_weights(read_checkpoint(path, source), format, backbone.name, source)
    if weights is None:
        raise ValueError(f"{source} is a contrastlab checkpoint: evaluate or resume it with --ckpt_path")
    if weights.classifier is None:
        raise ValueError(
            f"{source} (format {weights.format}) holds no classifier (PaCo's centres, a torchvision or timm fc): "
            "probe its trunk with main_linear.py"
        )
    recorded = exported_backbone(path, source)
    for key in ("name", "small_input", "small_input_stem"):  # the weights would load strictly into another stem too
        if recorded is not None and getattr(recorded, key) != getattr(backbone, key):
            raise ValueError(f"model.backbone.{key} {getattr(backbone, key)!r}, but {source} was exported from a trunk with {getattr(recorded, key)!r} (its export record): give that")
    load_state_strictly(trunk, weights.trunk, source, f"backbone {backbone.name!r} (small_input={backbone.small_input})")
    load_state_strictly(classifier, weights.classifier, source, f"the classifier (nn.Linear {classifier.in_features} -> {classifier.out_features})")
    exported = (export_record(path, source) or {}).get("classifier")
    return float(exported.get("tau_norm") or 0.0) if isinstance(exported, dict) else 0.0


def load_official_encoder(model, checkpoint: Any, format: str | None, source: str) -> str | None:
    """Load a loaded official checkpoint's trunk and projection head(s) into a pretraining method (`backbone`,
    `projector`, and `predictor` where the official code has one) strictly; return the format read, or
    None (nothing loaded) when it is a contrastlab checkpoint."""
    spec = BackboneSpec(**model.hparams["backbone"])
    weights = official_weights(checkpoint, format, spec.name, source)
    if weights is None:
        return None
    check_head_count(checkpoint, weights.format, spec, source)
    if "projector" not in weights.heads:
        raise ValueError(f"{source} (format {weights.format}) holds no projection head: the analysis measures the projector's output")
    load_state_strictly(model.backbone, weights.trunk, source, f"backbone {spec.name!r} (small_input={spec.small_input})")
    for role, head in weights.heads.items():
        load_state_strictly(getattr(model, role), head, source, f"the {role} of {type(model).__name__} as configured")
    # a release is one encoder (DINO's: its teacher): the model's momentum copies are it too, so that whichever encoder
    # an analysis reads (`evaluated_trunk`: DINO's teacher) is the release's, not the copies' random initialisation
    for online, target in getattr(model, "momentum_pairs", list)():
        target.load_state_dict(online.state_dict())
    return weights.format


def _name(backbone: BackboneSpec | dict | None) -> str | None:
    if backbone is None:
        return None
    return backbone.name if isinstance(backbone, BackboneSpec) else backbone.get("name")
