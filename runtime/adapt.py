"""Online adaptation of MTP heads while the model serves (`--adapt`, `load(adapt=True)`).

Verification gives training pairs for free: every drafted step i whose prefix the target kept
(the first rejected step included) pairs the head's features at that step with the token the
target put there. Between requests a few optimizer steps fit a correction of the head's output
layer on a bounded replay buffer of those pairs; drafting then uses

    logits' = draft_logits + U @ (V @ f),   f = final_norm(next_h)

where `draft_logits = lm_head(f)` and `next_h` are what every backend's draft step already
returns (the eager head, an ExecuTorch method or program, ONNX, Core ML): the program's weights
never change, so nothing is re-lowered. U [Vd, r] and V [r, D] are a low-rank dW; saving folds it
into the head (lm_head' = lm_head + U @ V, the same function of f), written as an ordinary heads
file that `--heads` and `mtp-export --heads` take.

The target decides every token as before: only the drafts change, so greedy output stays
token-identical to plain decoding and sampling keeps the target's distribution (the draft
distribution q is taken from the corrected logits, before drawing).

Training needs no weights of the program: a pair keeps the features f (float32), the draft
logits the program returned for them (float16) and the target's token; a step fits U and V by
cross-entropy of (stored logits + U V f) on a batch drawn from the buffer. The buffer is
preallocated (2048 pairs: 38 MB for a 576-wide head with 8192 draft tokens), so memory stays
flat however long the stream. A step's batch allocates and frees blocks of several MB (256 rows
of 8192 logits: 8 MB, and their gradient); glibc's malloc, once such a block is freed, serves
that size from its heap and keeps it resident, so an adapting model fixes the mmap threshold at
1 MB (`mtp_edge.memory.return_freed_memory`, for the whole process). Measured over 400 requests
(benchmarks/adapt_memory.py): RSS +40 MB over the second half with glibc's default, +0.4 with
the threshold fixed (the first half fills the buffer and the store); malloc's bytes in use
+0.2 either way.

Cost, bounded by accounting: each request earns `share` (default 10%) of its generation time as
credit (capped at 2 s, so idle time does not pile up into a long burst); optimizer steps run
after the request while the credit covers the measured time of one step, and what they take is
charged. Over a stream, adaptation time is at most the share of generation time plus one step.
Drafting pays a rank-r product per draft step (r * (D + Vd) multiply-adds, r = 32: ~280k on the
default head, ~4% of its step) and a copy of each step's outputs for the pairs.

Where the head stops short of k (its confidence below the floor), the store of past requests
(runtime/answer_store.py) goes on: where the context's last tokens were followed by the same
token in earlier requests, it drafts those tokens. The head always drafts first: measured on
refined heads, a store drafting before the head took positions from a head that knew them
better (benchmarks/README.md, "Online adaptation with a store of past requests"). Each
request's tokens enter the store after it ends, charged to the same time share; a request log
(`--log DIR`) seeds the store when the model loads.

What needs what: the features are final_norm(next_h), and saving folds U V into lm_head, so the
heads file the drafter was made from must be at hand. The eager drafter has it; a bundle's
program does not expose its weights and bundles do not carry the heads file, so the runtime
takes `--heads FILE` or the heads shipped for the model, checked against the bundle (same draft
vocabulary, and the training recipe its manifest records).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp_edge.errors import UserError
from mtp_edge.memory import return_freed_memory
from mtp_edge.mtp import MTPConfig, MTPHead, heads_file, save_heads
from mtp_edge.runtime.answer_store import AnswerStore
from mtp_edge.runtime.drafters import Draft, HybridDrafter
from mtp_edge.runtime.mtp_drafter import MtpDrafter

DEFAULT_SHARE = 0.10  # of generation time
DEFAULT_RANK = 32
# pairs: D float32 features, Vd float16 logits and a label each (38 MB for D = 576, Vd = 8192)
DEFAULT_BUFFER = 2048
CREDIT_CAP_S = 2.0  # most seconds of adaptation saved up between requests
MIN_PAIRS = 64  # no step before the buffer holds this many pairs
MAX_QUEUED = 512  # drafts whose pairs wait for the end of the request, at most
TAIL = 8  # tokens before a draft kept to recognise the context it was drafted in
# Adam's step size. Fitted offline on a 200-request stream (first-step pairs of requests 1-100,
# scored on 101-200): the rank-32 correction raised the first draft token's acceptance from
# 53.1% to 57.4% at 3e-4 and 600 steps, to 56.2% at 1e-3 (it fits the early requests' own
# tokens: 92% on them), 50.5% at 1e-2.
LEARNING_RATE = 3e-4


class ReplayBuffer:
    """The last `capacity` pairs: the head's features, the draft logits the program gave for
    them (float16) and the target's token as a draft-vocabulary index. Preallocated tensors: its
    memory is fixed at creation however long the stream."""

    def __init__(self, capacity: int, dim: int, vocab: int):
        if capacity < 1:
            raise UserError(f"the adaptation buffer needs >= 1 pair, got {capacity}")
        self.features = torch.zeros(capacity, dim)
        self.logits = torch.zeros(capacity, vocab, dtype=torch.float16)
        self.labels = torch.zeros(capacity, dtype=torch.long)
        self.capacity, self.size, self.next, self.added = capacity, 0, 0, 0

    def add(self, features: torch.Tensor, logits: torch.Tensor, labels: list[int]) -> None:
        """Rows of pairs, oldest first (of more than `capacity`, the newest are kept)."""
        self.added += len(labels)
        keep = min(len(labels), self.capacity)
        features, logits = features[len(labels) - keep :], logits[len(labels) - keep :]
        labels = torch.tensor(labels[len(labels) - keep :], dtype=torch.long)
        done = 0
        for lo, hi in self._slots(keep):
            rows = slice(done, done + hi - lo)
            self.features[lo:hi], self.logits[lo:hi] = features[rows], logits[rows]
            self.labels[lo:hi] = labels[rows]
            done += hi - lo

    def _slots(self, n: int) -> list[tuple[int, int]]:
        """The slice(s) of the ring the next `n` (<= capacity) rows go to."""
        first = min(n, self.capacity - self.next)
        slots = [(self.next, self.next + first)]
        if n > first:
            slots.append((0, n - first))
        self.next = (self.next + n) % self.capacity
        self.size = min(self.size + n, self.capacity)
        return slots

    def sample(self, n: int, generator: torch.Generator):
        rows = torch.randint(self.size, (min(n, self.size),), generator=generator)
        return self.features[rows], self.logits[rows].float(), self.labels[rows]


class Adapter:
    """The correction, its replay buffer and optimizer, and the time accounting."""

    def __init__(
        self,
        head: MTPHead,
        source: str,
        share: float = DEFAULT_SHARE,
        rank: int = DEFAULT_RANK,
        capacity: int = DEFAULT_BUFFER,
        batch: int = 256,
        lr: float = LEARNING_RATE,
        seed: int = 0,
    ):
        if not 0 < share <= 1:
            raise UserError(f"the adaptation share of generation time is in (0, 1], got {share}")
        self.head = head  # the heads the drafter was made from (folded into when saving)
        self.source = source  # where they came from, for the saved file's recipe
        self.share, self.batch = share, batch
        self.norm_weight = head.final_norm.weight.detach().float()
        self.eps = head.final_norm.eps
        vd, d = head.lm_head.weight.shape
        self.rng = torch.Generator().manual_seed(seed)
        self.u = torch.zeros(vd, rank, requires_grad=True)
        self.v = (torch.randn(rank, d, generator=self.rng) / math.sqrt(d)).requires_grad_()
        self.optimizer = torch.optim.Adam([self.u, self.v], lr=lr)
        self.buffer = ReplayBuffer(capacity, d, vd)
        self.index = {int(t): i for i, t in enumerate(head.draft_ids.tolist())}
        self.active = False  # a correction is applied once a step has trained one
        self._vw = self._ut = None  # V with the norm's weight folded in, U transposed
        self.credit = 0.0
        self.step_s: float | None = None  # measured time of one optimizer step
        self.steps = 0
        self.adapt_seconds = 0.0
        self.generation_seconds = 0.0
        self.store = AnswerStore()  # the requests served, drafted from where the head stops
        return_freed_memory()  # a step's multi-MB temporaries go back when freed
        self.queued: list[tuple] = []  # pairs of the request so far, filed when it ends

    def features(self, g: torch.Tensor) -> torch.Tensor:
        """final_norm(g) in float32, as the head computes it before its lm_head."""
        x = g.float()
        return self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def correct(self, logits: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The draft logits of the step whose next_h is `g`, corrected: U V final_norm(g), with
        the norm's weight folded into V (a few small operations per draft step)."""
        if not self.active:
            return logits
        x = g.float()
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return logits + ((x @ self._vw) * scale @ self._ut).to(logits.dtype)

    def add(self, gs: list[torch.Tensor], logits: list[torch.Tensor], tokens: list[int]) -> None:
        """Pairs of (a draft step's next_h and uncorrected draft logits, the target's token),
        kept as they are until the request ends (`file_pairs`): filing them inside the draft
        step cost ~0.05 of a decode step per verification."""
        self.queued.append((gs, logits, tokens))
        if len(self.queued) > MAX_QUEUED:  # a caller that never ends a request
            self.file_pairs()

    def file_pairs(self) -> None:
        """Move the queued pairs into the replay buffer."""
        queued, self.queued = self.queued, []
        gs, logits, labels = [], [], []
        for step_gs, step_logits, tokens in queued:
            for i, t in enumerate(tokens):
                if t in self.index:  # tokens outside the draft vocabulary teach nothing
                    gs.append(step_gs[i])
                    logits.append(step_logits[i])
                    labels.append(self.index[t])
        if labels:
            f = self.features(torch.stack(gs))
            self.buffer.add(f, torch.stack(logits).to(torch.float16), labels)

    def train_step(self) -> float:
        f, base, y = self.buffer.sample(self.batch, self.rng)
        loss = F.cross_entropy(base + (f @ self.v.T) @ self.u.T, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.refresh()
        self.steps += 1
        return loss.item()

    def refresh(self) -> None:
        """Drafting uses U and V as they are now."""
        with torch.no_grad():
            self._vw = (self.v * self.norm_weight).T.contiguous()
            self._ut = self.u.T.contiguous()
        self.active = True

    def after_request(
        self, generation_seconds: float, tokens: list[int] | None = None, prompt_len: int = 0
    ) -> int:
        """File the request's pairs and take in its tokens (the prompt's `prompt_len`, then the
        answer) for the store, then spend this request's share of time on optimizer steps;
        returns how many ran."""
        self.generation_seconds += generation_seconds
        self.credit = min(self.credit + self.share * generation_seconds, CREDIT_CAP_S)
        start = time.perf_counter()
        self.file_pairs()
        if tokens:
            self.store.add(tokens, prompt_len)
        took = time.perf_counter() - start
        self.credit -= took
        self.adapt_seconds += took
        ran = 0
        while self.buffer.size >= MIN_PAIRS and self.credit > 0:
            if self.step_s is not None and self.credit < self.step_s:
                break
            start = time.perf_counter()
            self.train_step()
            took = time.perf_counter() - start
            self.step_s = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took
            self.credit -= took
            self.adapt_seconds += took
            ran += 1
        return ran

    def folded_head(self) -> MTPHead:
        """A copy of the heads with the correction folded into the output layer."""
        head = MTPHead(self.head.config)
        head.load_state_dict(self.head.state_dict())
        head = head.float()
        with torch.no_grad():
            head.lm_head.weight += self.u @ self.v
        return head

    def save(self, path: str | Path) -> Path:
        """Write the adapted heads (a heads file as mtp-train writes) to `path`."""
        path = Path(path)
        if path.suffix != ".safetensors":
            raise UserError(f"adapted heads are saved as .safetensors, got {path}")
        config = MTPConfig.from_dict(self.head.config.to_dict())
        config.recipe = {
            **config.recipe,
            "adapted": {"from": self.source, "pairs": self.buffer.added, "steps": self.steps},
        }
        save_heads(self.folded_head(), config, path)
        return path

    def report(self) -> dict:
        share = self.adapt_seconds / self.generation_seconds if self.generation_seconds else 0.0
        return {
            **self.store.report(),
            "pairs": self.buffer.added,
            "buffered": self.buffer.size,
            "steps": self.steps,
            "adapt_seconds": round(self.adapt_seconds, 3),
            "generation_seconds": round(self.generation_seconds, 3),
            "share": round(share, 4),
        }


class AdaptingDrafter:
    """An MTP drafter whose draft logits get the adapter's correction, and which hands the
    adapter a pair for each drafted step the target verified (read from the context at the next
    call: the tokens the target put after a draft's start)."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, inner: MtpDrafter, adapter: Adapter):
        self.inner, self.adapter = inner, adapter
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # while drafting
        self.pending: tuple | None = None  # (start, tail, tokens, steps) of the last draft
        step = inner.step_fn

        def corrected(h, tokens, position):
            logits, g = step(h, tokens, position)
            if self.steps is not None:  # copies: a program may reuse its output buffers
                self.steps.append((g[-1].clone(), logits[-1].clone()))
            return adapter.correct(logits, g), g

        inner.step_fn = corrected

    def take_pairs(self, context: list[int]) -> None:
        """Pair the last draft's steps with the target's tokens, up to the first it rejected."""
        if self.pending is None:
            return
        start, tail, drafted, steps = self.pending
        if len(context) <= start or context[start - len(tail) : start] != tail:
            return  # not yet verified, or another context: keep it for the next call
        self.pending = None
        n = 0
        while n < len(drafted) and start + n < len(context):
            n += 1
            if context[start + n - 1] != drafted[n - 1]:
                break  # the first rejected step counts too
        gs, logits = [g for g, _ in steps[:n]], [z for _, z in steps[:n]]
        self.adapter.add(gs, logits, context[start : start + n])

    def propose(self, context, hidden, k, sampler) -> Draft:
        self.take_pairs(context)
        self.steps = []
        try:
            draft = self.inner.propose(context, hidden, k, sampler)
            steps = self.steps
        finally:
            self.steps = None
        if draft.tokens:
            start = len(context)
            tail = list(context[max(0, start - TAIL) : start])
            self.pending = (start, tail, list(draft.tokens), steps[: len(draft.tokens)])
        if len(draft.tokens) < k:  # the head stopped short: past requests may go on
            more = self.adapter.store.draft(list(context) + draft.tokens, k - len(draft.tokens))
            if more:
                draft = with_tokens(draft, more)
        return draft

    def observe(self, context, hidden) -> None:
        self.take_pairs(context)
        self.inner.observe(context, hidden)


def with_tokens(draft: Draft, tokens: list[int]) -> Draft:
    """`draft` continued by deterministic `tokens` (one-hot rows where the draft has a
    distribution per token, so that rejection sampling stays exact)."""
    if draft.probs is None:
        return Draft(draft.tokens + tokens)
    one_hot = torch.zeros(len(tokens), draft.probs.shape[1], dtype=draft.probs.dtype)
    one_hot[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return Draft(draft.tokens + tokens, torch.cat((draft.probs, one_hot)))


def check_can_adapt(spec: str | None) -> None:
    """--adapt needs an MTP head drafting (mtp or mtp+ngram); say so before anything loads."""
    if spec not in ("mtp", "mtp+ngram"):
        what = "no drafter" if spec in (None, "none") else f"the drafter '{spec}'"
        raise UserError(
            f"--adapt adapts MTP heads, and this setup drafts with {what}: use --drafter mtp "
            "(or a bundle with MTP heads), or drop --adapt"
        )


def bundle_heads(bundle, heads: str | None, use: str = "--adapt", flag: str = "--heads"):
    """The heads a bundle's MTP program was exported from and their path: `heads`, else those
    shipped for its model, checked against what the bundle records (draft vocabulary, recipe,
    sizes). `use` and `flag` name, in errors, what needs them and the option that gives them."""
    from safetensors import safe_open

    from mtp_edge.mtp import _METADATA_KEY, load_heads

    m = bundle.manifest
    path = heads_file(m.model_name, heads)
    if path is None:
        raise UserError(
            f"{use} on bundle {bundle.path} needs the heads file it was exported from (the "
            f"bundle carries them only inside its program): pass {flag} FILE"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            config = MTPConfig.from_dict(json.loads((f.metadata() or {})[_METADATA_KEY]))
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the one line below
        raise UserError(
            f"{path} is not an MTP heads file ({type(e).__name__}): pass the heads bundle "
            f"{bundle.path} was exported from with {flag}"
        ) from None

    class _Target:  # what load_heads checks: the sizes the bundle records
        dtype = torch.float32

        class config:  # noqa: N801
            hidden_size = m.drafter.hidden_size or config.hidden_size
            vocab_size = m.vocab_size

    head = load_heads(path, _Target, m.model_name, config.target_hash)
    vocab = json.loads((bundle.path / m.models["drafter_vocab"].file).read_text())
    # What identifies heads is how they were trained; a bundle whose heads were swapped in
    # (mtp-export --update-heads) also records the file's name and hash, and adapting adds a
    # mark, neither of which changes what the heads were trained as.
    bookkeeping = ("adapted", "heads_file", "heads_sha256")
    recipe = {k: v for k, v in head.config.recipe.items() if k not in bookkeeping}
    bundle_recipe = {k: v for k, v in (m.drafter.recipe or {}).items() if k not in bookkeeping}
    same_ids = head.draft_ids.tolist() == list(vocab["draft_ids"])
    if not same_ids or (bundle_recipe and recipe != bundle_recipe):
        carried = (m.drafter.recipe or {}).get("heads_file")
        which = f" (it carries {carried}, swapped in with --update-heads)" if carried else ""
        raise UserError(
            f"{path} are not the heads bundle {bundle.path} was exported from{which} (draft "
            f"vocabulary or training recipe differ): pass those with {flag} FILE"
        )
    return head.float(), str(path)


def adapting(drafter, head: MTPHead, source: str, **settings):
    """`drafter` (mtp, or mtp+ngram) drafting with a correction that learns, and its adapter."""
    adapter = Adapter(head, source, **settings)
    if isinstance(drafter, HybridDrafter):
        drafter.model = AdaptingDrafter(drafter.model, adapter)
        return drafter, adapter
    return AdaptingDrafter(drafter, adapter), adapter
