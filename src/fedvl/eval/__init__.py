"""Measurements: heterogeneity between clients (and, later, privacy attacks)."""
