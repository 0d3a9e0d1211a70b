"""Quantization schemes and their application per export target; the quality report."""
