"""Exporters, one module per target, and the bundle writer."""
