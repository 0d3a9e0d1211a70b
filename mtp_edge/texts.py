"""Text that is available offline: the held-out prose of the quality checks.

It is prose from the Python documentation that ships with the interpreter
(`pydoc_data.topics`); the topics below are reserved for evaluation (perplexity, drafter
acceptance) and never used to train drafters.
"""

from __future__ import annotations

HELDOUT_TOPICS = ("execmodel", "exceptions", "naming")


def heldout_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in HELDOUT_TOPICS)
