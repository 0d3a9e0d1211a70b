"""mtp-edge: speculative decoding for memory-bound phone and laptop chips.

    import mtp_edge
    llm = mtp_edge.load("default")
    print(llm.generate("Write a haiku.").text)

The API's names (mtp_edge/api.py) load on first use, so that `import mtp_edge` alone stays cheap.
"""

import os as _os

from mtp_edge.version import __version__

if _os.environ.get("MTP_EDGE_CPU_CLASS"):  # another CPU class's kernels: before anything loads
    from mtp_edge import cpu_class as _cpu_class

    _cpu_class.apply_at_import()

_API_NAMES = ("Chunk", "Completion", "ContextFull", "LoadOptions", "Model", "load")
__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str):
    if name in _API_NAMES:
        from mtp_edge import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
