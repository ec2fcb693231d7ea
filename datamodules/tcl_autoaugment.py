"""The CIFAR-10 AutoAugment of TCL's official code (chaitanyaanimesh/Tuned-Contrastive-Learning
data_augmentation/auto_augment.py, taken there from 4uiiurz1/pytorch-auto-augment), the augmentation of TCL's and
SupCon's runs in TCL's tables (train.py).

Its 25 sub-policies and their probabilities are AutoAugment's CIFAR-10 policy, as torchvision's; the operations are
not: a level l in 0..9 is a bin of an 11-point scale, and each application draws its strength uniformly within
[scale[l], scale[l + 1]] (Python's `random`, as there). The scales are signed for the geometric operations (level 5
is no change: level 2 always rotates by -18 to -12 degrees), the solarize threshold rises with the level and the
enhance factors run from 0.1 to 1.9; shears, translations and rotations are cubic-spline affine maps of each
channel (scipy.ndimage.affine_transform, black outside the image) about the image centre.
"""

import random

import numpy as np
from PIL import Image, ImageEnhance, ImageOps
from scipy import ndimage

# (operation, probability, level) twice: AutoAugment's CIFAR-10 policy as auto_augment.py lists it (its level
# 0.3 of an Invert of probability 0 never applies)
POLICIES = (
    ("Invert", 0.1, 7, "Contrast", 0.2, 6), ("Rotate", 0.7, 2, "TranslateX", 0.3, 9), ("Sharpness", 0.8, 1, "Sharpness", 0.9, 3),
    ("ShearY", 0.5, 8, "TranslateY", 0.7, 9), ("AutoContrast", 0.5, 8, "Equalize", 0.9, 2), ("ShearY", 0.2, 7, "Posterize", 0.3, 7),
    ("Color", 0.4, 3, "Brightness", 0.6, 7), ("Sharpness", 0.3, 9, "Brightness", 0.7, 9), ("Equalize", 0.6, 5, "Equalize", 0.5, 1),
    ("Contrast", 0.6, 7, "Sharpness", 0.6, 5), ("Color", 0.7, 7, "TranslateX", 0.5, 8), ("Equalize", 0.3, 7, "AutoContrast", 0.4, 8),
    ("TranslateY", 0.4, 3, "Sharpness", 0.2, 6), ("Brightness", 0.9, 6, "Color", 0.2, 8), ("Solarize", 0.5, 2, "Invert", 0.0, 0),
    ("Equalize", 0.2, 0, "AutoContrast", 0.6, 0), ("Equalize", 0.2, 8, "Equalize", 0.6, 4), ("Color", 0.9, 9, "Equalize", 0.6, 6),
    ("AutoContrast", 0.8, 4, "Solarize", 0.2, 8), ("Brightness", 0.1, 3, "Color", 0.7, 0), ("Solarize", 0.4, 5, "AutoContrast", 0.9, 3),
    ("TranslateY", 0.9, 9, "TranslateY", 0.7, 9), ("AutoContrast", 0.9, 2, "Solarize", 0.8, 3), ("Equalize", 0.8, 8, "Invert", 0.1, 3),
    ("TranslateY", 0.7, 9, "AutoContrast", 0.9, 1),
)  # fmt: skip

SCALES = {  # the (low, high) of each 11-point scale
    "ShearX": (-0.3, 0.3), "ShearY": (-0.3, 0.3), "TranslateX": (-150 / 331, 150 / 331), "TranslateY": (-150 / 331, 150 / 331),
    "Rotate": (-30.0, 30.0), "Solarize": (0.0, 256.0), "Posterize": (4.0, 8.0),
    "Contrast": (0.1, 1.9), "Color": (0.1, 1.9), "Brightness": (0.1, 1.9), "Sharpness": (0.1, 1.9),
}  # fmt: skip
ENHANCERS = {"Contrast": ImageEnhance.Contrast, "Color": ImageEnhance.Color, "Brightness": ImageEnhance.Brightness, "Sharpness": ImageEnhance.Sharpness}
PLAIN = {"AutoContrast": ImageOps.autocontrast, "Invert": ImageOps.invert, "Equalize": ImageOps.equalize}


def strength(operation: str, level: int) -> float:
    """A strength drawn uniformly within bin `level` of the operation's scale."""
    scale = np.linspace(*SCALES[operation], 11)
    return random.uniform(scale[level], scale[level + 1])


def affine(image: Image.Image, matrix: np.ndarray) -> Image.Image:
    """`matrix` (output pixel -> input pixel, in (row, column) coordinates) about the image centre, each channel by a
    cubic spline, black outside."""
    pixels = np.array(image)
    rows, columns = pixels.shape[:2]
    to_centre = np.array([[1, 0, rows / 2 + 0.5], [0, 1, columns / 2 + 0.5], [0, 0, 1]])
    from_centre = np.array([[1, 0, -(rows / 2 + 0.5)], [0, 1, -(columns / 2 + 0.5)], [0, 0, 1]])
    centred = to_centre @ matrix @ from_centre
    channels = [ndimage.affine_transform(pixels[:, :, channel], centred[:2, :2], centred[:2, 2]) for channel in range(pixels.shape[2])]
    return Image.fromarray(np.stack(channels, axis=2))


def apply(image: Image.Image, operation: str, level: int) -> Image.Image:
    if operation in PLAIN:
        return PLAIN[operation](image)
    value = strength(operation, level)
    if operation in ENHANCERS:
        return ENHANCERS[operation](image).enhance(value)
    if operation == "Solarize":
        return ImageOps.solarize(image, value)
    if operation == "Posterize":
        return ImageOps.posterize(image, int(round(value)))
    rows, columns = np.array(image).shape[:2]
    if operation == "Rotate":
        cos, sin = np.cos(np.deg2rad(value)), np.sin(np.deg2rad(value))
        return affine(image, np.array([[cos, -sin, 0], [sin, cos, 0], [0, 0, 1]]))
    matrix = {
        "ShearX": [[1, value, 0], [0, 1, 0], [0, 0, 1]],
        "ShearY": [[1, 0, 0], [value, 1, 0], [0, 0, 1]],
        "TranslateX": [[1, 0, 0], [0, 1, columns * value], [0, 0, 1]],
        "TranslateY": [[1, 0, rows * value], [0, 1, 0], [0, 0, 1]],
    }[operation]
    return affine(image, np.array(matrix, dtype=np.float64))


class TCLAutoAugment:
    """One random sub-policy of `POLICIES` per image, each of its two operations applied with its probability."""

    def __call__(self, image: Image.Image) -> Image.Image:
        first, first_probability, first_level, second, second_probability, second_level = POLICIES[random.randrange(len(POLICIES))]
        if random.random() < first_probability:
            image = apply(image, first, first_level)
        if random.random() < second_probability:
            image = apply(image, second, second_level)
        return image
