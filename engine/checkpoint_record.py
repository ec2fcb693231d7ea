"""The record that says what wrote a checkpoint, and whether this code may load it.

`CheckpointRecord` (a LightningModule mixin) writes the contrastlab version and the module's class under
`checkpoint["contrastlab"]` into every checkpoint (the CLI adds the resolved config). Loading one written by an
incompatible version, or a file that is no Lightning checkpoint, is a `CheckpointMismatch`; a Lightning checkpoint
without the record (written before it existed) loads with a warning. Which class a checkpoint names is
`methods.checkpoints.method_class`.
"""

import re
from importlib.metadata import version

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

VERSION = version("contrastlab")
RECORD_KEY = "contrastlab"


class CheckpointMismatch(ValueError):
    """A checkpoint that this code must not load."""


def compatible(saved: str, current: str = VERSION) -> bool:
    """Semantic versioning: the same major version; before 1.0 the same minor version too (0.y may break at every y)."""
    saved_major, saved_minor = map(int, re.match(r"(\d+)\.(\d+)", saved).groups())
    major, minor = map(int, re.match(r"(\d+)\.(\d+)", current).groups())
    return saved_major == major and (major > 0 or saved_minor == minor)


def checked_record(checkpoint: dict, source: str) -> dict | None:
    """The contrastlab record of a loaded checkpoint, after checking that this version can load it; None,
    with a warning, for a Lightning checkpoint without one (written before contrastlab 0.1.0 recorded
    versions: the runs measured in docs/results.md), which loads unchecked."""
    record = checkpoint.get(RECORD_KEY)
    if not isinstance(record, dict) or "version" not in record:
        if "pytorch-lightning_version" not in checkpoint:
            raise CheckpointMismatch(f"{source} is not a Lightning checkpoint and holds no contrastlab record (version, module class)")
        rank_zero_warn(f"{source} holds no contrastlab record (written before checkpoints recorded the version): loaded without a version check")
        return None
    if not compatible(record["version"]):
        raise CheckpointMismatch(
            f"{source} was written by contrastlab {record['version']} ({record.get('module')}), which this contrastlab "
            f"{VERSION} cannot load: checkpoints load within one major version (one minor version before 1.0)"
        )
    return record


class CheckpointRecord:
    """LightningModule mixin: record the version and the module class in every checkpoint, check them on every load
    (`--ckpt_path`, `load_from_checkpoint`)."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.setdefault(RECORD_KEY, {}).update(version=VERSION, module=f"{type(self).__module__}.{type(self).__qualname__}")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        checked_record(checkpoint, "the checkpoint being loaded")
        super().on_load_checkpoint(checkpoint)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """A strict load of tensors other than the model's, or of other shapes, is one error naming some of them (torch's
        is a traceback): a checkpoint of the method's code before a buffer or parameter was added, or of another
        configuration (a queue of another size)."""
        if strict:
            own = self.state_dict()
            missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
            if missing or unexpected:
                raise CheckpointMismatch(
                    f"the checkpoint being loaded does not fit this {type(self).__name__}: it lacks {len(missing)} of its tensors "
                    f"{missing[:3]} and holds {len(unexpected)} it has not {unexpected[:3]} (written by the method's code before a "
                    "buffer or parameter was added or removed, or with another configuration)"
                )
            reshaped = [f"{name} {tuple(state_dict[name].shape)} for {tuple(tensor.shape)}" for name, tensor in own.items() if state_dict[name].shape != tensor.shape]
            if reshaped:
                raise CheckpointMismatch(f"the checkpoint being loaded does not fit this {type(self).__name__}: {len(reshaped)} of its tensors have other "
                                         f"shapes ({', '.join(reshaped[:3])}): written with another configuration")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
