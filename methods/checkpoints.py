"""Which model a contrastlab checkpoint holds: the class it names, where that class lives now, and whether it is
one that a purpose can use (a linear probe needs a pretraining method's trunk, a resumed run its own class)."""

import importlib

from engine.checkpoint_record import CheckpointMismatch, checked_record
from engine.files import read_checkpoint

PACKAGES = ("methods", "engine", "datamodules", "backbones", "analysis", "interop")  # the project's (pyproject.toml)

# Model classes that moved since checkpoints recorded them (issue 23 moved the long-tail family into methods/longtail/)
MOVED_CLASSES = {
    "methods.paco.PaCo": "methods.longtail.paco.PaCo",
    "methods.paco_ride.PaCoRIDE": "methods.longtail.paco_ride.PaCoRIDE",
    "methods.multitask.MultiTaskContrast": "methods.longtail.multitask.MultiTaskContrast",
    "methods.longtail.CrossEntropy": "methods.longtail.cross_entropy.CrossEntropy",
}


def class_at(class_path: str) -> type:
    """The class a config or checkpoint names by its path, where it lives now (`MOVED_CLASSES`)."""
    module_name, _, class_name = MOVED_CLASSES.get(class_path, class_path).rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


def method_class(checkpoint: dict, source: str) -> tuple[str, type] | None:
    """The class path a loaded checkpoint names for its model (its contrastlab record's, else the `_class_path` that
    LightningCLI saved with the hyperparameters) and that class; None when the checkpoint names none. Checks the
    record's version (`checked_record`)."""
    record = checked_record(checkpoint, source) or {}
    class_path = record.get("module") or checkpoint.get("hyper_parameters", {}).get("_class_path")
    if class_path is None:
        return None
    try:
        return class_path, class_at(class_path)
    except (ImportError, AttributeError, TypeError) as error:
        outside = class_path.split(".")[0] not in PACKAGES
        if isinstance(error, ImportError) and outside:  # a method module outside the repository, not on the path here
            raise CheckpointMismatch(f"{source} names the class {class_path}, whose module cannot be imported here ({error}): "
                                     "a method outside methods/ needs its folder on PYTHONPATH") from None
        if isinstance(error, TypeError):  # the class breaks the method contract (methods/contract.py) when it is created
            raise CheckpointMismatch(f"{source} names the class {class_path}, which cannot be created here: {error}") from None
        raise CheckpointMismatch(f"{source} names the class {class_path}, which this contrastlab does not have") from None


def require_method(checkpoint, source: str, accepts: type, needs: str, class_required: bool = True) -> type | None:
    """The class a loaded contrastlab checkpoint names, when it is `accepts` or a subclass, for a purpose that needs
    such a model (`needs` says which, in the error). Without `class_required`, a checkpoint that names no class
    (written before checkpoints recorded it) is let through, with None."""
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointMismatch(f"{source} is not a contrastlab checkpoint (no Lightning state_dict): {needs}")
    recorded = method_class(checkpoint, source)
    if recorded is None and class_required:
        raise CheckpointMismatch(f"{source} does not name the class that wrote it: {needs}")
    if recorded is not None and not issubclass(recorded[1], accepts):
        raise CheckpointMismatch(f"{source} is a {recorded[0]} checkpoint: {needs}")
    return recorded and recorded[1]


def read_method_checkpoint(path, source: str, accepts: type, needs: str) -> tuple[dict, type]:
    """A contrastlab checkpoint read for a purpose that needs a model of class `accepts` (`require_method`), and
    the class it names."""
    checkpoint = read_checkpoint(path, source)
    return checkpoint, require_method(checkpoint, source, accepts, needs)


def trainable_classes(base: type) -> list[str]:
    """The names under `methods.` of the model classes a config's `model.class_path` may name for an entry point
    whose model class is `base`: those that define a training step (for --help)."""
    import methods  # the package that imports this module

    return [name for name in methods.__all__ if issubclass(getattr(methods, name), base) and getattr(methods, name).step is not methods.MethodBase.step]
