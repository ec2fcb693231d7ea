"""Where the training views are drawn, and from what: the one decision of the data pipeline.

`data.pipeline: cpu | gpu`, `data.resident` and whether the DataModule's images all have one size decide it
once, in `pipeline_mode`; the DataModule serves its loaders and draws its views by the mode
(`ContrastiveDataModule.training_dataset`, `images_on_device`, `view_batches`), and training, the
representation analysis and the throughput benchmark all go through those.
"""

from enum import Enum

PIPELINES = ("cpu", "gpu")  # the values of `data.pipeline`


class Pipeline(Enum):
    CPU = "cpu"  # per PIL image in the DataLoader workers
    RESIDENT = "resident"  # per batch on the device, from the training split decoded once and kept there
    STREAMED = "streamed"  # per batch on the device, from raw uint8 images of one size that the workers deliver
    ENCODED = "encoded"  # per batch on the device, from image files the workers read and the device decodes


def pipeline_mode(pipeline: str, resident: bool, uniform_image_size: bool) -> Pipeline:
    """The mode of `data.pipeline` and `data.resident` for a DataModule whose images do (or do not) all
    have one size: only images of one size stack into a resident tensor or a raw batch."""
    if pipeline not in PIPELINES:
        raise ValueError(f"data.pipeline must be one of {list(PIPELINES)}, got {pipeline!r}")
    if pipeline == "cpu":
        return Pipeline.CPU
    if not uniform_image_size:
        return Pipeline.ENCODED
    return Pipeline.RESIDENT if resident else Pipeline.STREAMED
