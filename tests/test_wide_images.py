"""A 16-bit grey PNG (common in medical and scientific image sets) is scaled to 8 bits, not clipped to white as
PIL's convert("RGB") does (issue 32, item 8), on both the per-image path and the device path."""

import numpy as np
import torch
from PIL import Image

from datamodules.encoded import read_for_device
from datamodules.image_files import read_rgb


def test_a_16_bit_png_is_scaled_to_8_bits_on_every_path(tmp_path):
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024 + 512)  # 512 ... 65,024: the whole 16-bit range
    path = tmp_path / "deep.png"
    Image.fromarray(ramp).save(path)
    with Image.open(path) as image:
        assert image.mode.startswith("I")  # PIL reads it as a wide integer image
    expected = np.repeat((ramp >> 8).astype(np.uint8)[..., None], 3, axis=2)
    assert np.array_equal(np.asarray(read_rgb(str(path))), expected)
    assert torch.equal(read_for_device(str(path)), torch.from_numpy(expected).permute(2, 0, 1))


def test_a_pgm_of_more_than_8_bits_is_scaled_to_8_bits_on_every_path(tmp_path):
    """PIL opens it as the 32-bit mode "I", its values scaled to 0..65535: shifted as 32-bit values, it would be black."""
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024 + 512)
    path = tmp_path / "deep.pgm"
    path.write_bytes(b"P5\n8 8\n65535\n" + ramp.astype(">u2").tobytes())  # the PGM format: big-endian 16-bit samples
    with Image.open(path) as image:
        assert image.mode == "I"
    expected = np.repeat((ramp >> 8).astype(np.uint8)[..., None], 3, axis=2)
    assert np.array_equal(np.asarray(read_rgb(str(path))), expected)
    assert torch.equal(read_for_device(str(path)), torch.from_numpy(expected).permute(2, 0, 1))


def test_an_8_bit_image_is_unchanged(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "rgb.png")
    assert np.array_equal(np.asarray(read_rgb(str(tmp_path / "rgb.png"))), pixels)
