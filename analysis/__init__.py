"""Representation analysis tools (uniformity, tolerance) used to study trained encoders."""
