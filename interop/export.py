"""Export the trunk of a contrastlab checkpoint for use elsewhere, with a JSON record of where it came from.

    python -m interop.export runs/moco_cifar10/checkpoints/last.ckpt --format torchvision
    python -m interop.export runs/sce_imagenet/checkpoints/last.ckpt --format detectron2 --out exports/sce_r50
    python -m interop.export runs/ce_cifar100_lt/checkpoints/last.ckpt --format torchvision --tau-norm 1.0

formats:
  torchvision  the trunk as the state dict of torchvision's ResNet / ResNeXt of the backbone's name, in
               <out>.pth and <out>.safetensors; without the classifier `fc` (set `model.fc = nn.Identity()`
               before a strict load), except for a long-tail classifier, whose classifier is `fc`. A
               small-input trunk has a 3x3 stride-1 `conv1` and no max-pool: <out>.json says how to build it.
  timm         the same for a `timm:<name>` backbone, loadable by `timm.create_model(name, num_classes=0)`
               or `pretrained_cfg_overlay=dict(file=...)`; for a Vision Transformer (`vit_tiny`, `vit_small`,
               `vit_base`, backbones/vit.py), by timm's `VisionTransformer` with the arguments <out>.json gives
               (MoCo v3's fixed position table and frozen patch projection are weights like the others).
  detectron2   <out>.pkl in the format of MoCo's detection/convert-pretrain-to-detectron2.py: {"model":
               numpy arrays under detectron2's ResNet names (stem.*, res2-res5, BatchNorm as
               convN.norm, the projection shortcut as shortcut / shortcut.norm), "__author__",
               "matching_heuristics": True}; torchvision ResNets / ResNeXts with the ImageNet stem only.

The trunk the method's paper evaluates is exported by default (`MethodBase.evaluated_encoder`): the online one
(MoCo's and JCL's main_lincls.py load `encoder_q`, SCE's linear evaluation `trunk`, ReSSL's linear_eval.py
`encoder_q`, PaCo predicts with `encoder_q` and its centres), DINO's teacher (eval_linear.py `--checkpoint_key
teacher`). `--encoder online` or `--encoder momentum` chooses.
A long-tail classifier's classifier is exported as `validate` predicts with it: PaCo's centres (bias
included), and the tau-normalised weights without bias when the model's `tau_norm` (or `--tau-norm`) is > 0.
"""

import argparse
import dataclasses
import hashlib
import importlib
import json
import math
import os
import pickle
import re
import sys
from pathlib import Path

import torch
import torchvision

from backbones import BackboneSpec, load_state_strictly
from backbones.factory import TORCHVISION_BUILDERS, small_input_padding
from backbones.vit import LAYER_NORM_EPS, VIT_SIZES, timm_arguments
from datamodules.folders import IMAGENET_MEAN, IMAGENET_STD
from engine.arguments import ScriptArgumentParser
from engine.config import as_spec
from engine.checkpoint_record import RECORD_KEY, VERSION
from engine.files import WriteFailed, check_folder, write_atomically
from interop.official import layout_of
from methods import FineTune, LongTailClassifier, PretrainMethod
from methods.checkpoints import read_method_checkpoint
from methods.probed_trunk import ENCODER_PREFIXES
from methods.longtail import tau_normalised

EXPORT_FORMATS = ("torchvision", "timm", "detectron2")
EXPORT_SUFFIXES = (".pth", ".safetensors", ".pkl", ".json")


def export(
    checkpoint_path: Path, format: str, out: Path | None = None, encoder: str | None = None, tau_norm: float | None = None, force: bool = False
) -> list[Path]:
    """Write the export files of `checkpoint_path` (a pretraining, fine-tuned or long-tail checkpoint) and the JSON record; return
    their paths. `encoder` None: the one the method's paper evaluates. `out` names the files without suffix (a suffix
    of theirs is dropped: `model.pth` writes `model.pth`, not `model.pth.pth`); files that exist are overwritten only
    with `force`."""
    source = f"checkpoint {str(checkpoint_path)!r}"
    if tau_norm is not None and not (math.isfinite(tau_norm) and tau_norm >= 0):
        raise ValueError(f"--tau-norm must be a finite number >= 0, got {tau_norm}")
    checkpoint, method_class = _read_contrastlab(checkpoint_path, source)
    encoder = encoder or method_class.evaluated_encoder
    hyperparameters = checkpoint.get("hyper_parameters", {})
    spec = as_spec(BackboneSpec, hyperparameters["backbone"])
    _check_exportable(spec, format, source)
    trunk, feature_dim = _checked_trunk(checkpoint["state_dict"], spec, encoder, source)
    is_classifier = issubclass(method_class, LongTailClassifier)
    if tau_norm is not None and not is_classifier:
        raise ValueError(f"--tau-norm applies to a long-tail classifier's classifier; {source} holds a {method_class.__name__}")
    if is_classifier and encoder != "online":
        raise ValueError(f"{source}: a long-tail classifier predicts with its online trunk (PaCo's inference uses encoder_q); export --encoder online")
    tau = (tau_norm if tau_norm is not None else hyperparameters.get("tau_norm", 0.0)) if is_classifier else None
    classifier = _classifier(checkpoint["state_dict"], tau) if is_classifier and format != "detectron2" else None

    folder = checkpoint_path.resolve().parent
    run = folder.parent if folder.name == "checkpoints" else folder  # as probe_run_directory finds the run of a checkpoint
    name = f"{checkpoint_path.stem}_{format}{'' if encoder == method_class.evaluated_encoder else '_' + encoder}"
    out = out / name if out is not None and out.is_dir() else out or run / "export" / name  # an existing folder: the files go in it
    out = out.with_suffix("") if out.suffix in EXPORT_SUFFIXES else out
    classifier_prefix = _classifier_prefix(spec, format, source) if classifier else None
    suffixes = (".pkl",) if format == "detectron2" else (".pth", ".safetensors")
    existing = [str(path) for path in (out.with_name(out.name + suffix) for suffix in (*suffixes, ".json")) if path.exists()]
    if existing and not force:
        raise ValueError(f"--out: {', '.join(existing)} already exists: give another --out, or --force to overwrite")
    files = [out.with_name(out.name + suffix) for suffix in suffixes]
    record = {
        "format": format,
        "files": [file.name for file in files],
        "checkpoint": str(checkpoint_path.resolve()),
        "method": f"{method_class.__module__}.{method_class.__qualname__}",
        "encoder": encoder,
        "trunk": {"name": spec.name, "small_input": spec.small_input, "small_input_stem": spec.small_input_stem, "kwargs": spec.kwargs, "feature_dim": feature_dim},
        "classifier": None if classifier is None else {"num_classes": len(classifier["weight"]), "tau_norm": tau, "keys": f"{classifier_prefix}*"},
        "load": _how_to_load(spec, format, files[-1].name, None if classifier is None else len(classifier["weight"])),
        **data_facts(checkpoint.get(RECORD_KEY, {}).get("config")),
        "epoch": checkpoint.get("epoch"),
        "step": checkpoint.get("global_step"),
        "config_sha256": config_hash(checkpoint.get(RECORD_KEY, {}).get("config")),
        "contrastlab_version": VERSION,
    }
    if format == "detectron2":
        record["detectron2_config"] = detectron2_config(spec, record["normalisation"])
    check_folder(out.parent, "the export folder")
    json_path = out.with_name(out.name + ".json")
    # Everything is known before the first file is written. The record goes last, and an overwritten one goes first:
    # weights whose writing fails are never left beside a record of other weights (`exported_backbone` trusts it).
    json_path.unlink(missing_ok=True)
    if format == "detectron2":
        weights = {"model": {detectron2_name(key): value.numpy() for key, value in trunk.items()}, "__author__": "contrastlab", "matching_heuristics": True}
        write_atomically(files[0], lambda partial: partial.write_bytes(pickle.dumps(weights)))
    else:
        state = trunk | ({classifier_prefix + key: value for key, value in classifier.items()} if classifier else {})
        write_atomically(files[0], lambda partial: torch.save(state, partial))
        write_atomically(files[1], lambda partial: _save_safetensors(state, partial))
    write_atomically(json_path, lambda partial: partial.write_text(json.dumps(record, indent=1)))
    return [*files, json_path]


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors creates its file 0600; give it the mode of any new file, as the .pth has
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _read_contrastlab(path: Path, source: str) -> tuple[dict, type]:
    needs = "export a pretraining, fine-tuned or long-tail checkpoint (a linear probe's trunk is the pretraining checkpoint's)"
    return read_method_checkpoint(path, source, (PretrainMethod, FineTune, LongTailClassifier), needs)


def _check_exportable(spec: BackboneSpec, format: str, source: str) -> None:
    if format == "timm":
        if not spec.name.startswith("timm:") and spec.name not in VIT_SIZES:
            raise ValueError(f"{source}: backbone {spec.name!r} is not a timm model; export it with --format torchvision (timm's {spec.name} has the same names)")
    elif spec.name not in TORCHVISION_BUILDERS:
        raise ValueError(f"{source}: backbone {spec.name!r} is not a torchvision ResNet / ResNeXt, which --format {format} writes")
    elif format == "detectron2" and spec.small_input:
        raise ValueError(f"{source}: backbone {spec.name!r} has the small-input stem (3x3, no max-pool); detectron2's ResNet stem is 7x7 stride 2 with max-pool")


def _checked_trunk(state: dict, spec: BackboneSpec, encoder: str, source: str) -> tuple[dict[str, torch.Tensor], int]:
    """The trunk's weights, checked by a strict load into the trunk the backbone spec builds."""
    prefix = ENCODER_PREFIXES[encoder]
    trunk = {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
    if not trunk:
        raise ValueError(f"{source} has no {encoder} encoder ('{prefix}*'): only the methods with a momentum encoder have one")
    module, feature_dim = dataclasses.replace(spec, weights=None).build()
    load_state_strictly(module, trunk, source, f"backbone {spec.name!r} (small_input={spec.small_input})")
    # contiguous: channels-last runs too; float32: a bf16-true run's weights (detectron2's numpy has no bf16)
    return {key: value.detach().contiguous().clone().to(torch.float32 if value.is_floating_point() else value.dtype) for key, value in trunk.items()}, feature_dim


def _classifier(state: dict, tau: float) -> dict[str, torch.Tensor]:
    """The prediction layer of `LongTailClassifier.classify` / `CrossEntropy.classify` as an nn.Linear's weights; PaCo on
    RIDE's with one expert (its prediction, the mean over the experts, is then that expert's layer)."""
    if "classifier.weight" not in state and "classifier.experts.0.weight" in state:
        if "classifier.experts.1.weight" in state:
            raise ValueError("the classifier has several RIDE experts, each on its own features: its prediction, their mean, is no one nn.Linear to export")
        state = {key.replace("classifier.experts.0.", "classifier."): value for key, value in state.items()}
    weight, bias = state["classifier.weight"].float(), state["classifier.bias"].float()  # float32 as the trunk
    if tau:
        weight, bias = tau_normalised(weight, tau), torch.zeros_like(bias)
    return {"weight": weight.contiguous().clone(), "bias": bias.clone()}


def _classifier_prefix(spec: BackboneSpec, format: str, source: str) -> str:
    if format == "torchvision":
        return "fc."
    if spec.name in VIT_SIZES:
        return "head."  # timm's VisionTransformer classifier
    prefixes = layout_of("timm", spec.name, source).classifier
    if not prefixes:
        raise ValueError(f"{source}: timm does not name the classifier of {spec.name!r} (pretrained_cfg 'classifier')")
    return prefixes[0]


def detectron2_name(key: str) -> str:
    """A torchvision ResNet trunk key under detectron2's name, by the renaming rules of MoCo's converter."""
    key = key if key.startswith("layer") else f"stem.{key}"
    key = re.sub(r"layer(\d)", lambda match: f"res{int(match[1]) + 1}", key)
    key = re.sub(r"bn(\d)", r"conv\1.norm", key)
    return key.replace("downsample.0", "shortcut").replace("downsample.1", "shortcut.norm")


def detectron2_config(spec: BackboneSpec, normalisation: dict | None) -> dict:
    """The detectron2 settings these weights need, as MoCo's detection configs set them: torchvision puts the
    stride in the 3x3 convolution, and the images are RGB normalised as in training (pixel scale 0-255); without a
    recorded normalisation, ImageNet's RGB statistics, as facebookresearch/moco detection/configs/Base-RCNN-C4-BN.yaml
    (detectron2's own defaults are BGR means, which an RGB input would take in the wrong order)."""
    depth, groups, width = re.fullmatch(r"res(?:net|next)(\d+)(?:_(\d+)x(\d+)d)?", spec.name).groups()
    settings = {"MODEL.RESNETS.DEPTH": int(depth), "MODEL.RESNETS.STRIDE_IN_1X1": False, "INPUT.FORMAT": "RGB"}
    if groups:
        settings |= {"MODEL.RESNETS.NUM_GROUPS": int(groups), "MODEL.RESNETS.WIDTH_PER_GROUP": int(width)}
    if int(depth) < 50:  # basic blocks: detectron2 requires 64 channels after res2 for R18/R34
        settings["MODEL.RESNETS.RES2_OUT_CHANNELS"] = 64
    normalisation = normalisation or {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    return settings | {"MODEL.PIXEL_MEAN": [round(255 * m, 3) for m in normalisation["mean"]], "MODEL.PIXEL_STD": [round(255 * s, 3) for s in normalisation["std"]]}


def _token_features(features: dict | None) -> str:
    """The ViT `features` option (`backbones.vit.TokenFeatures`) as a `features(images)` function of the loaded
    `model`, whose own forward gives the last class token only."""
    if features is None:
        return ""
    taken = (f"model.forward_intermediates(x, indices={features.get('last_blocks', 1)}, return_prefix_tokens=True, norm=True, "
             "output_fmt='NLC', intermediates_only=True)")  # [(patch tokens, prefix tokens)] of the last blocks
    class_tokens = "torch.cat([prefix[:, 0] for _, prefix in taken], dim=-1)"
    if features.get("average_patch_tokens"):
        class_tokens = f"torch.stack([{class_tokens}, taken[-1][0].mean(dim=1)], dim=-1).flatten(1)"
    return f"; features = lambda x: (lambda taken: {class_tokens})({taken})"


def _how_to_load(spec: BackboneSpec, format: str, file: str, num_classes: int | None) -> str:
    """Python that builds the exported model outside contrastlab and loads the file strictly."""
    if format == "detectron2":
        return f"detectron2: MODEL.WEIGHTS {file} with the settings of detectron2_config"
    if format == "timm" and spec.name in VIT_SIZES:
        arguments = ", ".join(f"{key}={value!r}" for key, value in timm_arguments(spec.name, spec.kwargs).items())
        return (
            f"model = timm.models.vision_transformer.VisionTransformer({arguments}, num_classes={num_classes or 0}, "
            f"norm_layer=functools.partial(torch.nn.LayerNorm, eps={LAYER_NORM_EPS})); "
            f"model.load_state_dict(safetensors.torch.load_file({file!r}), strict=True)" + _token_features(spec.kwargs.get("features"))
        )
    if format == "timm":
        arguments = "".join(f", {key}={value!r}" for key, value in spec.kwargs.items())
        return (
            f"model = timm.create_model({spec.name.removeprefix('timm:')!r}, num_classes={num_classes or 0}{arguments}); "
            f"model.load_state_dict(safetensors.torch.load_file({file!r}), strict=True)"
        )
    arguments = [f"{key}={value!r}" for key, value in spec.kwargs.items()] + ([f"num_classes={num_classes}"] if num_classes else [])
    if spec.name in torchvision.models.list_models():
        builder = f"torchvision.models.{spec.name}({', '.join(arguments)})"
    else:  # resnext101_32x4d, which torchvision does not name (backbones.factory)
        arguments = ["torchvision.models.resnet.Bottleneck", "[3, 4, 23, 3]", "groups=32", "width_per_group=4", *arguments]
        builder = f"torchvision.models.resnet.ResNet({', '.join(arguments)})"
    steps = [f"model = {builder}"]
    if spec.small_input:
        padding = small_input_padding(spec.small_input_stem)
        steps += [f"model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding={padding}, bias=False)", "model.maxpool = torch.nn.Identity()"]
    if not num_classes:
        steps.append("model.fc = torch.nn.Identity()")
    steps.append(f"model.load_state_dict(safetensors.torch.load_file({file!r}), strict=True)")
    return "; ".join(steps)


def data_facts(config: dict | None) -> dict:
    """Dataset, image size and normalisation of the run, from its resolved config (null where it does not say). The
    normalisation is the evaluation view's (a view's own mean / std, else the DataModule's); training views that
    normalised otherwise are listed in `training_normalisation` (npid_cifar100 normalises with CIFAR-10's mean)."""
    data = (config or {}).get("data") or {}
    if "class_path" not in data:
        return {"dataset": None, "image_size": None, "normalisation": None}
    module_name, _, class_name = data["class_path"].rpartition(".")
    try:
        data_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):  # a DataModule of the user's, not importable here: what the config says
        data_class = None
    init_args = data.get("init_args") or {}
    value = lambda name: init_args.get(name, getattr(data_class, name, None))  # noqa: E731  (folders take them as arguments)

    def normalisation(view: dict | None) -> dict | None:
        mean, std = ((view or {}).get(key, value(key)) for key in ("mean", "std"))
        return None if mean is None or std is None else {"mean": list(mean), "std": list(std)}

    evaluated = normalisation(init_args.get("eval_view"))
    differing = {name: normalisation(view) for name, view in (init_args.get("views") or {}).items() if normalisation(view) != evaluated}
    return {"dataset": data["class_path"], "image_size": value("image_size"), "normalisation": evaluated} | (
        {"training_normalisation": differing} if differing else {}
    )


def config_hash(config: dict | None) -> str | None:
    """sha256 of the resolved config stored in the checkpoint, as JSON with sorted keys."""
    return None if config is None else hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = ScriptArgumentParser(prog="python -m interop.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a main_pretrain.py checkpoint (pretraining or long-tail) or a fine-tuned one (main_linear.py, methods.FineTune)")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="what to write (see formats above)")
    parser.add_argument("--encoder", choices=tuple(ENCODER_PREFIXES), help="which trunk (default: the one the method's paper evaluates: online; DINO's teacher, momentum)")
    parser.add_argument("--tau-norm", type=float, help="tau of the classifier's normalisation (default: the model's tau_norm)")
    parser.add_argument("--out", type=Path, help="path of the files without suffix, or an existing folder to write them into (default: <run>/export/<checkpoint>_<format>, the run being the folder above checkpoints/, else the checkpoint's own)")
    parser.add_argument("--force", action="store_true", help="overwrite export files that exist")
    args = parser.parse_args(argv)
    try:
        written = export(args.checkpoint, args.format, args.out, args.encoder, args.tau_norm, args.force)
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    print("\n".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
