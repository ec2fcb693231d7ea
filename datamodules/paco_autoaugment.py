"""The CIFAR-10 AutoAugment of PaCo's official code (dvlab-research/Parametric-Contrastive-Learning
PaCo/LT/autoaug.py, `CIFAR10Policy`), the query view of PaCo's CIFAR-LT runs (PaCo/LT/paco_cifar.py).

Its 25 sub-policies and probabilities are AutoAugment's CIFAR-10 policy, each level a fixed strength of a 10-point
scale, as torchvision's; the operations differ from torchvision's in what they fill and how they turn: the pixels a
shear, translation or rotation uncovers are grey (128), a rotation always turns counter-clockwise (torchvision: either
way), shears resample bicubically (torchvision: nearest), and the solarize scale runs from 256 to 0 (torchvision: 255).
Random draws as there (Python's `random`): the sub-policy, each operation's chance, a sign where an operation has one.
"""

import random

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from datamodules.tcl_autoaugment import POLICIES  # the same 25 sub-policies (operations, probabilities, levels)

GREY = (128, 128, 128)
SCALES = {  # the strength of each level 0..9
    "ShearX": np.linspace(0, 0.3, 10), "ShearY": np.linspace(0, 0.3, 10),
    "TranslateX": np.linspace(0, 150 / 331, 10), "TranslateY": np.linspace(0, 150 / 331, 10), "Rotate": np.linspace(0, 30, 10),
    "Color": np.linspace(0.0, 0.9, 10), "Contrast": np.linspace(0.0, 0.9, 10), "Sharpness": np.linspace(0.0, 0.9, 10),
    "Brightness": np.linspace(0.0, 0.9, 10), "Posterize": np.round(np.linspace(8, 4, 10), 0).astype(int), "Solarize": np.linspace(256, 0, 10),
}  # fmt: skip
ENHANCERS = {"Color": ImageEnhance.Color, "Contrast": ImageEnhance.Contrast, "Sharpness": ImageEnhance.Sharpness, "Brightness": ImageEnhance.Brightness}
PLAIN = {"AutoContrast": ImageOps.autocontrast, "Equalize": ImageOps.equalize, "Invert": ImageOps.invert}


def sign() -> int:
    return random.choice([-1, 1])


def apply(image: Image.Image, operation: str, level: int) -> Image.Image:
    if operation in PLAIN:
        return PLAIN[operation](image)
    strength = SCALES[operation][level]
    if operation in ENHANCERS:
        return ENHANCERS[operation](image).enhance(1 + strength * sign())
    if operation == "Posterize":
        return ImageOps.posterize(image, int(strength))
    if operation == "Solarize":
        return ImageOps.solarize(image, strength)
    if operation == "Rotate":  # counter-clockwise only, composited onto grey
        turned = image.convert("RGBA").rotate(strength)
        return Image.composite(turned, Image.new("RGBA", turned.size, (128,) * 4), turned).convert(image.mode)
    width, height = image.size
    if operation == "ShearX":
        return image.transform(image.size, Image.AFFINE, (1, strength * sign(), 0, 0, 1, 0), Image.BICUBIC, fillcolor=GREY)
    if operation == "ShearY":
        return image.transform(image.size, Image.AFFINE, (1, 0, 0, strength * sign(), 1, 0), Image.BICUBIC, fillcolor=GREY)
    if operation == "TranslateX":
        return image.transform(image.size, Image.AFFINE, (1, 0, strength * width * sign(), 0, 1, 0), fillcolor=GREY)
    return image.transform(image.size, Image.AFFINE, (1, 0, 0, 0, 1, strength * height * sign()), fillcolor=GREY)  # TranslateY


class PacoAutoAugment:
    """One random sub-policy per image, each of its two operations applied with its probability."""

    def __call__(self, image: Image.Image) -> Image.Image:
        first, first_probability, first_level, second, second_probability, second_level = POLICIES[random.randint(0, len(POLICIES) - 1)]
        if random.random() < first_probability:
            image = apply(image, first, first_level)
        if random.random() < second_probability:
            image = apply(image, second, second_level)
        return image
