"""Figures of Wang & Liu's analysis, written as PNG files.

Drawn on `matplotlib.figure.Figure` with the Agg canvas (no pyplot, no display, no global backend
state), so they work in training callbacks, on clusters and in tests.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from engine.files import write_atomically

__all__ = ["plot_against_temperature", "plot_local_separation", "plot_negative_entropy"]

SIMILARITY_BINS = [-1 + i / 40 for i in range(81)]  # cosine similarities, 80 bins over [-1, 1]


def save_figure(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    write_atomically(path, FigureCanvasAgg(figure).print_png)  # a figure is whole or absent
    return path


def plot_local_separation(positive: Tensor, nearest_negatives: Tensor, path: str | Path, title: str = "") -> Path:
    """Wang & Liu supplementary, Figs. 1-7: histograms, over all anchors, of the similarity to the positive ('pos')
    and to the i-th nearest negative ('n1' ... 'nk'); a gap between them is a strong local separation. The negatives are
    the analysed subset's other images, not the author code's whole memory bank: from a smaller pool the nearest
    negatives lie farther (docs/usage.md, "Representation analysis")."""
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot()
    count = nearest_negatives.shape[1]
    for rank in range(count):
        shade = 0.2 + 0.6 * rank / max(count - 1, 1)  # n1 darkest
        axes.hist(nearest_negatives[:, rank].cpu().numpy(), bins=SIMILARITY_BINS, histtype="step",
                  color=(shade, shade, 0.9), label=f"n{rank + 1}")
    axes.hist(positive.cpu().numpy(), bins=SIMILARITY_BINS, alpha=0.6, color="tab:red", label="pos")
    axes.set(xlabel="cosine similarity to the anchor", ylabel="anchors", title=title)
    axes.legend(ncol=2, fontsize="small")
    return save_figure(figure, path)


def plot_negative_entropy(entropy: Tensor, path: str | Path, title: str = "") -> Path:
    """Histogram of H(r_i), the entropy of each anchor's softmax over its N - 1 negatives; the dashed
    line is its maximum log(N - 1), reached when every negative is penalised equally."""
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot()
    axes.hist(entropy.cpu().numpy(), bins=50, color="tab:blue")
    axes.axvline(math.log(len(entropy) - 1), color="black", linestyle="--", label="log(N - 1)")
    axes.set(xlabel="entropy of the softmax over negatives (nats)", ylabel="anchors", title=title)
    axes.legend(fontsize="small")
    return save_figure(figure, path)


def plot_against_temperature(
    curves: dict[str, dict[float, dict[str, float]]], panels: dict[str, str], path: str | Path, title: str = ""
) -> Path:
    """One panel per metric (`panels`: metric key -> axis label), one line per curve (e.g. per loss);
    `curves[name][temperature][metric]` is a measured value (missing metrics are skipped)."""
    figure = Figure(figsize=(4 * len(panels), 3.5), layout="constrained")
    for axes, (metric, label) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        for name, points in curves.items():
            measured = sorted((tau, values[metric]) for tau, values in points.items() if values.get(metric) is not None)
            if measured:
                axes.plot(*zip(*measured), marker="o", label=name)
        axes.set(xlabel="temperature", ylabel=label)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title)
    return save_figure(figure, path)
