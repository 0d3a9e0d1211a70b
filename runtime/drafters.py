"""Drafters: they propose the next few tokens; the target decides which to keep.

Every drafter answers `propose(context, hidden, k, sampler)`:
- context: all tokens so far (prompt + generated); the last one is not yet in the target's cache.
- hidden: the target's hidden states [n, D] for the positions it processed in its last call and
  kept (the prompt after prefill; the accepted inputs after a verify) — what an MTP head reads.
  Drafters with `needs_hidden = False` get None, and the loop does not ask the target for them.
- k: the most tokens to propose (fewer, or none, is fine); with k = 0 a drafter that keeps state
  still takes in `hidden`.
Drafters keep whatever state they like between calls, but must cope with any context: the loop
may rewind (a new prompt, or the next turn of a conversation whose start is still cached) or
extend it by any number of tokens. `observe(context, hidden)` tells a drafter about a step it did
not draft for (another drafter did, or generation ended); most ignore it. A drafter made of
several (the hybrid) may say which of them drafts next, `source(context)`, for the fallback
(runtime/fallback.py), which measures each source apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mtp_edge.errors import UserError
from mtp_edge.runtime.sampling import Sampler
from mtp_edge.runtime.session import Session, prefill


@dataclass
class Draft:
    tokens: list[int]
    # probs[i] is the distribution tokens[i] was drawn from; None means chosen deterministically
    # (greedy or lookup), which rejection sampling treats as a one-hot distribution.
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    name: str
    needs_hidden: bool

    def propose(
        self, context: list[int], hidden: torch.Tensor | None, k: int, sampler: Sampler
    ) -> Draft: ...

    def observe(self, context: list[int], hidden: torch.Tensor | None) -> None:
        """The verified rows of a step that another drafter drafted for."""


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and
    propose what followed it. Free to run, strong on text that repeats its input (code edits,
    summaries, extraction), silent elsewhere.

    It keeps an index from every n-gram of the context to where its latest occurrence ends, and
    extends it by the tokens each call adds, so a call costs a few dictionary lookups however long
    the context is (searching the whole context at every step cost more than a small model's
    draft step). A context that is not an extension of the last one is indexed anew.
    """

    name = "ngram"
    needs_hidden = False

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise UserError(f"n-gram sizes need 1 <= min <= max, got min {min_n}, max {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.indexed: list[int] = []  # the tokens whose n-grams are in the index
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ends

    def _index(self, context) -> None:
        """Index the n-grams that end before the context's last token (each has a token after
        it to propose)."""
        known = len(self.indexed)
        if known > len(context) or self.indexed != context[:known]:
            self.indexed, self.ends, known = [], {}, 0
        for end in range(max(known - 1, 1), len(context)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(context[end - n : end])] = end
        self.indexed += context[known:]

    def propose(self, context, hidden, k, sampler) -> Draft:
        self._index(context)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(context[-n:]))
            if end is not None:
                return Draft([int(t) for t in context[end : end + k]])
        return Draft([])

    def observe(self, context, hidden) -> None:
        pass  # it indexes the context at its next call


class HybridDrafter:
    """Prompt lookup where the context repeats itself, a model drafter elsewhere.

    The n-gram drafter is free and right where the output copies its input (summaries,
    extraction, code edits); an MTP head or draft model is right on new text. When the context's
    last `min_match` (or more) tokens occurred before, the lookup's continuation is proposed;
    otherwise the model drafts. A drafter that must see every verified position (a self MTP
    head: its cache) is told about the positions it did not draft for (`observe`).
    """

    def __init__(self, model, max_n: int = 3, min_match: int = 1):
        if not 1 <= min_match <= max_n:
            raise UserError(f"n-gram sizes need 1 <= min <= max, got min {min_match}, max {max_n}")
        self.model = model
        self.lookup = NgramDrafter(max_n=max_n, min_n=min_match)
        self.name = f"{model.name}+ngram"
        self.needs_hidden = model.needs_hidden
        self.from_lookup = 0  # drafts the lookup made (for reports)

    def source(self, context) -> str:
        """Which drafter the next proposal comes from (they differ in cost and acceptance)."""
        return "lookup" if self.lookup.propose(context, None, 1, None).tokens else self.model.name

    def propose(self, context, hidden, k, sampler) -> Draft:
        draft = self.lookup.propose(context, None, k, sampler) if k > 0 else Draft([])
        if not draft.tokens:
            return self.model.propose(context, hidden, k, sampler)
        self.model.observe(context, hidden)
        self.from_lookup += 1
        return draft

    def observe(self, context, hidden) -> None:
        self.model.observe(context, hidden)


class DraftModelDrafter:
    """A separate small LM with the target's vocabulary and its own static KV cache.

    It remembers which tokens its cache holds; on each call it keeps the longest prefix shared
    with the new context and feeds the rest (rejected drafts are overwritten, never copied).
    Drafting stops early when the drafter's own probability of its token falls below
    `min_confidence` (0 = always draft k).
    """

    name = "draft-lm"
    needs_hidden = False

    def __init__(self, session: Session, min_confidence: float = 0.0):
        if not 0 <= min_confidence < 1:
            raise UserError(f"draft confidence threshold must be in [0, 1), got {min_confidence}")
        self.session = session
        self.min_confidence = min_confidence
        self.cached: list[int] = []

    def _feed(self, context: list[int]) -> torch.Tensor:
        """Bring the cache up to `context`; returns the logits after its last token."""
        keep = 0
        limit = min(len(self.cached), len(context) - 1)  # always re-feed at least the last token
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        self.cached = self.cached[:keep]  # true even if the prefill below is interrupted
        logits = prefill(self.session, context[keep:], keep).logits
        self.cached = list(context)
        return logits[-1]

    def propose(self, context, hidden, k, sampler) -> Draft:
        k = min(k, self.session.max_seq_len - len(context))
        if k <= 0:
            return Draft([])
        logits = self._feed(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            if sampler.greedy:
                q = torch.softmax(logits.to(torch.float64), -1)
            else:
                q = sampler.probs(logits)
            # Decide before drawing: a stop rule that looked at the drawn token would bias the
            # tokens that are kept away from q, and rejection sampling needs them drawn from q.
            if tokens and q.max() < self.min_confidence:
                break
            token = int(torch.argmax(q)) if sampler.greedy else sampler.sample(q)
            tokens.append(token)
            probs.append(q)
            if len(tokens) == k:
                break
            logits = self.session.forward([token], len(self.cached)).logits[-1]
            self.cached.append(token)
        return Draft(tokens, None if sampler.greedy else torch.stack(probs))

    def observe(self, context, hidden) -> None:
        pass  # its cache catches up with the context at the next proposal


def check_same_vocabulary(
    target_tokens: dict, draft_tokens: dict, target_vocab: int, draft_vocab: int
):
    """A drafter's token ids mean nothing to the target unless both vocabularies are identical.

    target_tokens/draft_tokens map token strings to ids; *_vocab are the models' logit widths.
    """
    if target_vocab != draft_vocab or target_tokens != draft_tokens:
        raise UserError(
            f"the draft model's vocabulary ({draft_vocab} logits) differs from the target's "
            f"({target_vocab} logits): use a draft model with the target's tokenizer "
            "(same family), or --drafter ngram"
        )
