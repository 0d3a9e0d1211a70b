"""Drafting from a deployment's own past requests: an n-gram table over the recent ones.

Requests to one deployment resemble each other (the same kinds of questions, the same phrasing
and code in the answers), and prompt lookup sees only the request at hand. The store keeps the
token sequences of the last requests served (prompt and answer) and, for each context of 4, 3
or 2 tokens in them, how often each next token followed. A draft continues the context with the
most frequent next token of its longest known context, for as long as that token followed at
least `min_count` times and in at least `min_share` of the cases (a confident continuation).
The adapting drafter (runtime/adapt.py) asks it where the MTP head stops short of k.

The drafts are deterministic, like prompt lookup's, so the target's verification treats them as
one-hot proposals: greedy output stays identical to plain decoding and sampling keeps the
target's distribution. What the store learns changes only which tokens are proposed.

A conversation is counted once: a chat's next request sends the whole conversation so far (its
prompt begins with the last request's prompt and goes on), and where it begins with the last
request's tokens, those positions were counted already with the same contexts; only the rest is
counted (and kept, with the last tokens before it as context). Where the earlier answer's text
encodes to other tokens than the model wrote, it is counted again from there. Separate requests,
alike or not, are each counted whole.

Bounded: when the sequences hold more than `max_tokens` tokens, the oldest are dropped and their
counts taken back, so memory follows `max_tokens`, not the length of the stream: measured 0.3 KB
a token on a themed stream (7 MB for 21k tokens), 1 KB where no context repeats (random
tokens), so at most ~34 MB at the default bound. It is what llama.cpp's dynamic lookup cache
does across runs, kept in memory and fed from the request log when one is kept (`--log DIR`).
"""

from __future__ import annotations

from collections import defaultdict, deque

ORDERS = (4, 3, 2)
MAX_TOKENS = 32768
MIN_COUNT = 2
MIN_SHARE = 0.5


class AnswerStore:
    def __init__(
        self, max_tokens: int = MAX_TOKENS, min_count: int = MIN_COUNT, min_share: float = MIN_SHARE
    ):
        self.max_tokens, self.min_count, self.min_share = max_tokens, min_count, min_share
        self.tables: dict[int, dict[tuple[int, ...], dict[int, int]]] = {
            n: defaultdict(lambda: defaultdict(int)) for n in ORDERS
        }
        # per request: its tokens kept and the index from which their next tokens were counted
        self.sequences: deque[tuple[list[int], int]] = deque()
        self.tokens = 0  # in self.sequences
        self.last: list[int] = []  # the last request's tokens, whole
        self.last_prompt = 0  # how many of them were its prompt
        self.drafts = 0  # drafts made (for reports)

    def add(self, tokens: list[int], prompt_len: int) -> None:
        """One request's tokens (its prompt, the first `prompt_len`, and its answer), counted past
        the last request where it continues that conversation; then the oldest requests dropped
        past the bound."""
        tokens = [int(t) for t in tokens]
        shared = 0
        continued = (
            prompt_len > self.last_prompt
            and tokens[: self.last_prompt] == self.last[: self.last_prompt]
        )
        if continued:
            for a, b in zip(self.last, tokens, strict=False):
                if a != b:
                    break
                shared += 1
        self.last, self.last_prompt = tokens, prompt_len
        cut = max(0, len(tokens) - self.max_tokens)  # a request longer than the store: its end
        tokens, shared = tokens[cut:], max(0, shared - cut)
        start = max(0, shared - max(ORDERS))  # the shared part's last tokens: the new contexts
        kept, first = tokens[start:], shared - start
        self._count(kept, first, +1)
        self.sequences.append((kept, first))
        self.tokens += len(kept)
        while self.tokens > self.max_tokens:
            old, old_first = self.sequences.popleft()
            self._count(old, old_first, -1)
            self.tokens -= len(old)

    def _count(self, tokens: list[int], first: int, sign: int) -> None:
        """Count (or take back) the next tokens at tokens[first:] after their contexts."""
        for n in ORDERS:
            table = self.tables[n]
            for j in range(max(n, first), len(tokens)):
                key = tuple(tokens[j - n : j])
                nexts = table[key]
                nexts[tokens[j]] += sign
                if nexts[tokens[j]] == 0:
                    del nexts[tokens[j]]
                    if not nexts:
                        del table[key]

    def next(self, context: list[int]) -> int | None:
        """The confident next token after `context`, from its longest context the store knows."""
        for n in ORDERS:
            if len(context) < n:
                continue
            nexts = self.tables[n].get(tuple(context[-n:]))
            if nexts:
                token, count = max(nexts.items(), key=lambda kv: kv[1])
                confident = count >= self.min_count and count >= self.min_share * sum(
                    nexts.values()
                )
                return token if confident else None
        return None

    def draft(self, context: list[int], k: int) -> list[int]:
        tail = list(context[-max(ORDERS) :])
        out: list[int] = []
        while len(out) < k:
            token = self.next(tail + out)
            if token is None:
                break
            out.append(token)
        self.drafts += bool(out)
        return out

    def report(self) -> dict:
        return {
            "store_tokens": self.tokens,
            "store_requests": len(self.sequences),
            "store_drafts": self.drafts,
        }
