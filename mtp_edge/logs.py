"""Keeping the terminal for our own progress and errors."""

from __future__ import annotations

import logging
import warnings


def quiet_library_noise() -> None:
    """torch/torchao/ExecuTorch deprecation notes and optional-kernel load failures say nothing
    a user of our commands can act on."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*[Mm]utation on a buffer.*")
    for name in ("torchao", "torch.utils._pytree", "torch._export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
