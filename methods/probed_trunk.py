"""Which trunk a probe or a fine-tuning loads, and what its checkpoint says about its pretraining.

`probed_trunk` reads the trunk weights from a contrastlab pretraining checkpoint (the online trunk `backbone.*`, or
the momentum trunk `target_backbone.*`), an export (`interop.export`) or an official release (`interop.official`);
`trunk_as_trained` holds a contrastlab checkpoint to the trunk it recorded; `pretraining_summary` is what the
linear stage prints and checks against its data (method, trunk, dataset, image size, epoch, step).
"""

import contextlib
import dataclasses
import importlib

import torch

from backbones import BackboneSpec
from engine.checkpoint_record import RECORD_KEY, CheckpointMismatch
from engine.config import as_spec
from engine.files import read_checkpoint
from interop.official import export_record, exported_backbone, official_trunk
from methods.checkpoints import require_method
from methods.pretrain import PretrainMethod

__all__ = ["ENCODER_PREFIXES", "pretraining_summary", "probed_trunk", "trunk_as_trained"]

ENCODER_PREFIXES = {"online": "backbone.", "momentum": "target_backbone."}


def probed_trunk(
    path: str, format: str | None, backbone: BackboneSpec | dict | None, encoder: str | None = None
) -> tuple[dict[str, torch.Tensor], BackboneSpec | dict | None, dict]:
    """The trunk weights to probe, the backbone spec (`backbone`, else the one the checkpoint or its export record
    names, or its weights show) and what the checkpoint says about its pretraining, from one read of the file: an official
    release (`interop.official`) or a contrastlab pretraining checkpoint's online (`backbone.*`) or momentum
    (`target_backbone.*`) trunk; `encoder` None: the one its method's paper evaluates (`MethodBase.evaluated_encoder`)."""
    if encoder not in (None, *ENCODER_PREFIXES):
        raise ValueError(f"model.pretrained_encoder {encoder!r} is none of {list(ENCODER_PREFIXES)}")
    source = f"model.pretrained_ckpt {path!r}"
    checkpoint = read_checkpoint(path, source)
    exported = exported_backbone(path, source)  # an export's record names its trunk, stem included
    official = official_trunk(checkpoint, format, trunk_as_trained(exported, backbone, source), source, encoder)
    if official is not None:  # an export's record says what the checkpoint it came from said
        return *official, pretraining_summary(checkpoint, export_record(path, source))
    needs = "the linear stage probes the trunk of a pretraining method (methods.PretrainMethod, e.g. methods.MoCoV2)"
    method = require_method(checkpoint, source, PretrainMethod, needs, class_required=False)
    encoder = encoder or (method.evaluated_encoder if method is not None else "online")
    prefix = ENCODER_PREFIXES[encoder]
    state = {key.removeprefix(prefix): value for key, value in checkpoint["state_dict"].items() if key.startswith(prefix)}
    if not state:
        what = "not a contrastlab pretraining checkpoint" if encoder == "online" else "its method has no momentum encoder (model.pretrained_encoder)"
        raise CheckpointMismatch(f"{source} holds no '{prefix}*' weights: {what}")
    recorded = checkpoint.get("hyper_parameters", {}).get("backbone")
    return state, trunk_as_trained(recorded, backbone, source), pretraining_summary(checkpoint)


def trunk_as_trained(recorded: BackboneSpec | dict | None, given: BackboneSpec | dict | None, source: str) -> BackboneSpec | dict | None:
    """The trunk a contrastlab checkpoint is probed with: the one it recorded, with the features the config's
    `backbone` asks for (`kwargs.features`); anything else the config gives must agree with the recorded trunk, or
    a ViT of another head count (the same tensor shapes) would load strictly and be probed as another network."""
    if recorded is None or given is None:
        return given if given is not None else recorded
    trained, asked, default = as_spec(BackboneSpec, recorded), as_spec(BackboneSpec, given), BackboneSpec()
    # a field at BackboneSpec's default may be one the config left out (the parser fills it in): only the others count
    differing = [(name, getattr(asked, name), f"with {getattr(trained, name)!r}") for name in ("name", "small_input", "small_input_stem")
                 if getattr(asked, name) != getattr(default, name) and getattr(asked, name) != getattr(trained, name)]
    differing += [(f"kwargs.{key}", value, f"with {trained.kwargs[key]!r}" if key in trained.kwargs else "without it")
                  for key, value in asked.kwargs.items() if key != "features" and trained.kwargs.get(key) != value]
    if differing:
        key, value, trained_with = differing[0]
        raise CheckpointMismatch(
            f"model.backbone.{key} {value!r}, but {source} was trained {trained_with}: the trunk is probed as it was "
            "trained (drop model.backbone, or give only its kwargs.features)"
        )
    return dataclasses.replace(trained, kwargs=trained.kwargs | ({"features": asked.kwargs["features"]} if "features" in asked.kwargs else {}))


def pretraining_summary(checkpoint, export: dict | None = None) -> dict:
    """What a checkpoint says about its pretraining: its method, trunk, dataset (the DataModule class) and image size,
    epoch and step; `?` for what it does not record (an official release records some of it, or none). An export's
    record (`interop.export`) says what the checkpoint it was exported from said."""

    def entry(mapping, key: str):
        return mapping.get(key) if isinstance(mapping, dict) else None

    if export is not None:
        method, backbone, dataset = entry(export, "method"), entry(entry(export, "trunk"), "name"), entry(export, "dataset")
        image_size, epoch, step = entry(export, "image_size"), entry(export, "epoch"), entry(export, "step")
    else:
        record = entry(checkpoint, RECORD_KEY)
        data = entry(entry(record, "config"), "data")
        method, backbone = entry(record, "module"), entry(entry(entry(checkpoint, "hyper_parameters"), "backbone"), "name")
        dataset, image_size = entry(data, "class_path"), entry(entry(data, "init_args"), "image_size")
        epoch, step = entry(checkpoint, "epoch"), entry(checkpoint, "global_step")
    if dataset is not None and image_size is None:  # a class attribute (Digits-M, CIFAR: 32 px)
        module_name, _, class_name = dataset.rpartition(".")
        with contextlib.suppress(ImportError):
            image_size = getattr(getattr(importlib.import_module(module_name), class_name, None), "image_size", None)
    found = {"method": method, "backbone": backbone, "dataset": dataset.rsplit(".", 1)[-1] if dataset else None, "image_size": image_size,
             "epoch": epoch, "step": step}
    return {key: "?" if value is None else value for key, value in found.items()}
