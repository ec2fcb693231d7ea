"""What a device does cheaply."""

import torch


def host_reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a tensor's values on the host costs nothing: on the CPU it does not; on an accelerator it
    stalls the step until the device has caught up with the queued work (issue 11). Checks of values (labels in
    range, a prior that sums to 1) and value-dependent branches run only where this holds: the DataModules check
    labels when they build them, and the methods' own buffers hold what the methods put there."""
    return tensor.device.type == "cpu"
