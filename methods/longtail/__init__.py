"""Long-tailed recognition: the classifier family of PaCo and its baselines (Cui et al., ICCV 2021)."""

from methods.longtail.base import LongTailClassifier, SupervisedMoCoMixin
from methods.longtail.cross_entropy import CrossEntropy, tau_normalised
from methods.longtail.multitask import MultiTaskContrast
from methods.longtail.paco import PaCo
from methods.longtail.paco_ride import PaCoRIDE

__all__ = ["CrossEntropy", "LongTailClassifier", "MultiTaskContrast", "PaCo", "PaCoRIDE", "SupervisedMoCoMixin", "tau_normalised"]
