"""The commands (click only: the work is done by the modules they call), one module per command
family. User errors print one line and exit 2; nothing prints a traceback."""

from mtp_edge.cli.bench import bench, devices, predict, profile
from mtp_edge.cli.common import OneLineErrors
from mtp_edge.cli.export import export
from mtp_edge.cli.run import run
from mtp_edge.cli.train import train

__all__ = ["OneLineErrors", "bench", "devices", "export", "predict", "profile", "run", "train"]
