"""Quantization schemes per platform, applied a part of the model at a time; the quality report
(perplexity before and after, verify-vs-step)."""
