"""Vision Transformers through timm's `VisionTransformer`, with the options of the official self-supervised recipes.

Sizes (`VIT_SIZES`) are timm's / DeiT's: ViT-Tiny 192-d with 3 heads, ViT-Small 384-d with 6, ViT-Base 768-d with
12, depth 12, patch 16 at 224 px. Any `VisionTransformer` argument can be given on top (`img_size`, `patch_size`,
`depth`, `num_heads`, `drop_path_rate`, ...), e.g. a ViT for 32 px images: `{img_size: 32, patch_size: 4}`.
MoCo v3's ViT-Small has 12 heads, not DeiT's 6 (facebookresearch/moco-v3 README, vits.py `vit_small`): its configs
say `num_heads: 12`. The feature is the class token after the final LayerNorm (timm's `global_pool="token"`,
as moco-v3 vits.py and its main_lincls.py use it).

Options of the official code that change results, each a keyword of the backbone spec:
- `init: mocov3`: moco-v3 vits.py `VisionTransformerMoCo.__init__`: xavier-uniform Linear weights, the qkv
  projection as three separate matrices, zero biases, class token N(0, 1e-6), and the patch projection
  xavier-uniform over its flattened 3 x p x p input (timm's `weight_init="moco"` leaves the patch projection out);
- `position_embedding: sincos_2d`: the fixed 2-D sin-cos table of moco-v3 vits.py
  `build_2d_sincos_position_embedding` (temperature 10,000; per patch [sin, cos] of its row, then of its column;
  a zero row for the class token), not trained;
- `stop_grad_conv1: true`: the patch projection stays at its random initialisation (moco-v3 `--stop-grad-conv1`,
  "random patch projection", MoCo v3 paper section 5.3);
- `init: dino`: facebookresearch/dino vision_transformer.py: timm's initialisation (truncated normal 0.02 for the
  Linear weights and the position table, zero biases) except the class token, truncated normal 0.02 too (timm: 1e-6);
- `position_interpolation: dino`: images of another size than `img_size` (DINO's 96 px local crops of a 224 px ViT)
  get the position table resized as DINO's `interpolate_pos_encoding`: bicubic, by the scale factor
  (grid + 0.1) / side, without antialiasing. timm's `dynamic_img_size` resizes to the grid size with antialiasing,
  after casting to float32, which gives other tables (vision_transformer.py `_pos_embed`, layers/pos_embed.py).
DINO's ViT-S/16 is `{name: vit_small, kwargs: {init: dino, position_interpolation: dino, drop_path_rate: 0.1}}`,
ViT-S/8 adds `patch_size: 8` (main_dino.py `--arch vit_small --patch_size 8 --drop_path_rate 0.1`).

The feature the trunk gives, `features: {last_blocks: n, average_patch_tokens: bool}` (default: the class token of
the last block, the above): DINO's linear evaluation (facebookresearch/dino eval_linear.py, `get_intermediate_layers`
of its vision_transformer.py) applies the final LayerNorm to the tokens of each of the last n blocks and concatenates
their class tokens, n x D wide (n = 4 for ViT-S: 1,536); with `average_patch_tokens` (its ViT-B protocol, n = 1) the
class token and the mean of the patch tokens of that block, 2 x D wide, interleaved as eval_linear.py flattens them
(class_0, mean_0, class_1, mean_1, ...), so that its released linear weights fit. It changes no weight: a trunk
pretrained without it is probed with it.
"""

import dataclasses
import functools
import math
from functools import partial
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

VIT_SIZES = {
    "vit_tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(embed_dim=768, depth=12, num_heads=12),
}
# LayerNorm eps 1e-6 and qkv biases as moco-v3 vits.py and timm's ViTs
LAYER_NORM_EPS = 1e-6
BLOCK_OPTIONS = dict(mlp_ratio=4.0, qkv_bias=True)
OWN_OPTIONS = ("init", "position_embedding", "position_interpolation", "stop_grad_conv1", "features")  # applied here to timm's model, not timm arguments


def timm_arguments(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `VisionTransformer` arguments of the trunk `name` with the backbone spec's `kwargs`, except
    `norm_layer` (LayerNorm with eps `LAYER_NORM_EPS`) and `num_classes` (0 for the trunk)."""
    return VIT_SIZES[name] | BLOCK_OPTIONS | {key: value for key, value in kwargs.items() if key not in OWN_OPTIONS}


def build_vit(
    name: str,
    init: Literal["timm", "mocov3", "dino"] = "timm",
    position_embedding: Literal["learned", "sincos_2d"] = "learned",
    stop_grad_conv1: bool = False,
    position_interpolation: Literal["timm", "dino"] = "timm",
    features: dict[str, Any] | None = None,
    **timm_kwargs: Any,
) -> tuple[nn.Module, int]:
    """A `VisionTransformer` of size `name` without classifier, and its feature size (the embedding dimension, or
    that of the `features` option's concatenation)."""
    from timm.models.vision_transformer import VisionTransformer  # lazily: timm is only needed for ViTs

    if init not in ("timm", "mocov3", "dino"):
        raise ValueError(f"backbone {name!r}: init must be 'timm', 'mocov3' or 'dino', got {init!r}")
    if position_interpolation not in ("timm", "dino"):
        raise ValueError(f"backbone {name!r}: position_interpolation must be 'timm' or 'dino', got {position_interpolation!r}")
    if position_interpolation == "dino":
        VisionTransformer = dino_interpolating_vision_transformer()  # noqa: N806
        timm_kwargs = timm_kwargs | dict(dynamic_img_size=True)
    if position_embedding not in ("learned", "sincos_2d"):
        raise ValueError(f"backbone {name!r}: position_embedding must be 'learned' or 'sincos_2d', got {position_embedding!r}")
    options = timm_arguments(name, timm_kwargs) | dict(norm_layer=partial(nn.LayerNorm, eps=LAYER_NORM_EPS))
    options |= dict(num_classes=0, weight_init="moco" if init == "mocov3" else "")
    if features is not None:
        token_features = TokenFeatures.parse(name, features, options["depth"])
        VisionTransformer = token_feature_vision_transformer(VisionTransformer)  # noqa: N806
        options |= dict(token_features=token_features)
    try:
        trunk = VisionTransformer(**options)
    except TypeError as error:
        raise ValueError(f"backbone {name!r} rejected its keyword arguments {timm_kwargs}: {error}") from None
    projection = trunk.patch_embed.proj
    if init == "mocov3":
        bound = math.sqrt(6.0 / (projection.in_channels * math.prod(projection.kernel_size) + trunk.embed_dim))
        nn.init.uniform_(projection.weight, -bound, bound)
        nn.init.zeros_(projection.bias)
    if position_interpolation == "dino" and (trunk.cls_token is None or trunk.reg_token is not None or trunk.no_embed_class):
        raise ValueError(f"backbone {name!r}: position_interpolation dino needs a class token, no register tokens and a table over both")
    if init == "dino":
        nn.init.trunc_normal_(trunk.cls_token, std=0.02)
    if position_embedding == "sincos_2d":
        if trunk.num_prefix_tokens != 1 or trunk.pos_embed is None:
            raise ValueError(f"backbone {name!r}: position_embedding sincos_2d needs one class token and a position table")
        with torch.no_grad():
            trunk.pos_embed.copy_(sincos_2d_position_embedding(trunk.patch_embed.grid_size, trunk.embed_dim)[None])
        trunk.pos_embed.requires_grad_(False)
    if stop_grad_conv1:
        projection.requires_grad_(False)
    if features is None:
        return trunk, trunk.num_features
    if trunk.cls_token is None:
        raise ValueError(f"backbone {name!r}: features {features} concatenate class tokens, and this ViT has none (class_token false)")
    return trunk, trunk.embed_dim * (token_features.last_blocks + token_features.average_patch_tokens)


@dataclasses.dataclass(frozen=True)
class TokenFeatures:
    """The `features` option of a ViT trunk (the module docstring): the class tokens of the last `last_blocks` blocks
    after the final norm, with the mean of the last block's patch tokens beside its class token if
    `average_patch_tokens` (facebookresearch/dino eval_linear.py `--n_last_blocks`, `--avgpool_patchtokens`)."""

    last_blocks: int = 1
    average_patch_tokens: bool = False

    @classmethod
    def parse(cls, name: str, features: Any, depth: int) -> "TokenFeatures":
        where = f"backbone {name!r}: features {features!r}"
        known = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(features, dict) or not set(features) <= known:
            raise ValueError(f"{where} must be a mapping of {', '.join(sorted(known))}")
        parsed = cls(**features)
        if isinstance(parsed.last_blocks, bool) or not isinstance(parsed.last_blocks, int) or not 1 <= parsed.last_blocks <= depth:
            raise ValueError(f"{where}: last_blocks must be an integer from 1 to the depth, {depth}")
        if not isinstance(parsed.average_patch_tokens, bool):
            raise ValueError(f"{where}: average_patch_tokens must be true or false")
        if parsed.average_patch_tokens and parsed.last_blocks != 1:
            # eval_linear.py stacks the class tokens and the patch mean on a new axis, which only fits one block's
            raise ValueError(f"{where}: average_patch_tokens needs last_blocks 1, the only case DINO's eval_linear.py defines")
        return parsed


def sincos_2d_position_embedding(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """(1 + rows * columns, dim): a zero row for the class token, then per patch in row-major order
    [sin(r w), cos(r w), sin(c w), cos(c w)] with w_d = temperature^(-d / (dim / 4)), d < dim / 4 (moco-v3 vits.py)."""
    if dim % 4:
        raise ValueError(f"a 2-D sin-cos position embedding needs an embedding dimension divisible by 4, got {dim}")
    rows, columns = torch.meshgrid(torch.arange(grid_size[0], dtype=torch.float32), torch.arange(grid_size[1], dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    row_angles, column_angles = rows.flatten()[:, None] * omega, columns.flatten()[:, None] * omega
    table = torch.cat([row_angles.sin(), row_angles.cos(), column_angles.sin(), column_angles.cos()], dim=1)
    return torch.cat([torch.zeros(1, dim), table])


def dino_position_embedding(table: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The position table (1, 1 + side^2, D) of a square grid, for a grid of `rows` x `columns` patches: the class
    token's row kept, the patches' rows resized by bicubic interpolation with the scale factor (rows + 0.1) / side,
    (columns + 0.1) / side (facebookresearch/dino vision_transformer.py `interpolate_pos_encoding`; the 0.1 keeps
    the floating-point output size from falling below the grid)."""
    side = math.isqrt(table.shape[1] - 1)
    if rows == columns == side:
        return table
    grid = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((rows + 0.1) / side, (columns + 0.1) / side), mode="bicubic")
    if grid.shape[-2:] != (rows, columns):
        raise ValueError(f"DINO's position interpolation made a {tuple(grid.shape[-2:])} grid from {side} x {side}, not {rows} x {columns}")
    return torch.cat([table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, rows * columns, -1)], dim=1)


@functools.cache
def token_feature_vision_transformer(base: type) -> type:
    """`base` (timm's `VisionTransformer` or a subclass) whose forward gives the `TokenFeatures` it is built with;
    the blocks run once, through timm's `forward_intermediates`, which applies the final norm to every output taken."""

    class TokenFeatureVisionTransformer(base):
        def __init__(self, token_features: TokenFeatures, **kwargs: Any):
            super().__init__(**kwargs)
            self.token_features = token_features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            taken = self.forward_intermediates(
                x, indices=self.token_features.last_blocks, return_prefix_tokens=True, norm=True, output_fmt="NLC", intermediates_only=True
            )  # [(patch tokens, prefix tokens)] of the last blocks, in block order; the class token is the first prefix token
            class_tokens = torch.cat([prefix[:, 0] for _, prefix in taken], dim=-1)
            if not self.token_features.average_patch_tokens:
                return class_tokens
            patch_mean = taken[-1][0].mean(dim=1)
            return torch.stack([class_tokens, patch_mean], dim=-1).flatten(1)  # interleaved, as eval_linear.py's reshape

    return TokenFeatureVisionTransformer


@functools.cache
def dino_interpolating_vision_transformer() -> type:
    """timm's `VisionTransformer` (built with `dynamic_img_size`) whose position table follows each input's patch
    grid by `dino_position_embedding`; made on first use, since timm is imported lazily."""
    from timm.models.vision_transformer import VisionTransformer

    class DINOInterpolatingVisionTransformer(VisionTransformer):
        def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
            batch, rows, columns, dim = x.shape  # the patch grid (dynamic_img_size keeps it unflattened)
            tokens = torch.cat([self.cls_token.expand(batch, -1, -1), x.reshape(batch, rows * columns, dim)], dim=1)
            return self.pos_drop(tokens + dino_position_embedding(self.pos_embed, rows, columns))

    return DINOInterpolatingVisionTransformer
