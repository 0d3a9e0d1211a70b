"""The version of mtp-edge: what `--version` prints and a bundle's manifest records as its
exporter's. Ground layer, so that the manifest needs nothing above it."""

__version__ = "0.1.0"
