"""Representation analysis of Wang & Liu (CVPR 2021) and Wang & Isola (ICML 2020): uniformity,
tolerance, local separation and the entropy over negatives, as functions (`analysis.metrics`), figures
(`analysis.figures`), a Lightning callback (`RepresentationAnalysis`) and a command for any
pretraining checkpoint (`python -m analysis`)."""

from analysis.callback import RepresentationAnalysis
from analysis.representation import RepresentationReport, analyse

__all__ = ["RepresentationAnalysis", "RepresentationReport", "analyse"]
