"""mtp-edge: speculative decoding for memory-bound phone and laptop chips."""

__version__ = "0.1.0"
