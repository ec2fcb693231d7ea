"""Representation analysis of a pretrained encoder: Wang & Liu (CVPR 2021) and Wang & Isola (ICML 2020)'s
uniformity, tolerance, local separation and entropy over negatives, and the collapse indicators RankMe and
SimSiam's std, as functions (`analysis.metrics`), figures (`analysis.figures`); embedding maps
(`analysis.embedding_map`) and few-shot linear probes (`analysis.few_shot`); Lightning callbacks
(`RepresentationAnalysis`, `CollapseMonitor`, `EmbeddingMap`) and a command for any pretraining checkpoint
(`python -m analysis`)."""

from analysis.callback import RepresentationAnalysis
from analysis.monitors import CollapseMonitor, EmbeddingMap
from analysis.representation import RepresentationReport, analyse

__all__ = ["CollapseMonitor", "EmbeddingMap", "RepresentationAnalysis", "RepresentationReport", "analyse"]
