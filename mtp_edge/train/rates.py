"""What a run measures on this machine: the labelling and training-step rates before writing
(the budget's split needs them) and, at the end, what a draft step costs next to the target's."""

from __future__ import annotations

import copy
import time

import torch

from mtp_edge.model import Transformer
from mtp_edge.mtp import MTPConfig, MTPHead
from mtp_edge.train.budget import Budget
from mtp_edge.train.corpus import Sequence
from mtp_edge.train.labels import label_sequences, label_with_session
from mtp_edge.train.losses import IGNORE, draft_losses, origin_batch, weighted_loss

# The probe: this many random tokens labelled, and training steps timed after one warm-up step.
PROBE_TOKENS = 256
PROBE_STEPS = 3
PROBE_SECONDS = 10.0  # no more steps once they took this long (a 3B target's head is slow)
# The draft vocabulary a probe head gets under --draft-vocab auto (the size is chosen later,
# on the labels; a typical choice for a 32k-150k vocabulary).
PROBE_DRAFT_VOCAB = 8192


def measure_rates(budget: Budget, target: Transformer, session, options, say=None) -> None:
    """Fill budget.label_tps and budget.step_s: label PROBE_TOKENS random tokens (the cost of
    labelling does not depend on the text) the way the run will label, then time training
    steps of a fresh head of the run's design on them. Heads with attention train on whole
    sequences, which this probe does not build: it times the head's MLP and LM head at the
    batch size, a lower bound for them."""
    c = target.config
    generator = torch.Generator().manual_seed(0)
    length = max(8, min(PROBE_TOKENS, options.seq_len))
    tokens = torch.randint(c.vocab_size, (length,), generator=generator).tolist()
    probe = [Sequence(tokens, 0)]
    say = say or (lambda _: None)
    say(f"measuring the rates: labelling {length} tokens, then {PROBE_STEPS} training steps")
    seconds = []
    # The first call also sizes the cache; a second is timed unless the first was slow already
    # (then the first is the rate: a slow labeller would spend minutes on the probe alone).
    while len(seconds) < 2 and sum(seconds) < PROBE_SECONDS:
        began = time.perf_counter()
        if session is None:
            labels = label_sequences(target, probe)
        else:
            labels = label_with_session(session, probe)
        seconds.append(time.perf_counter() - began)
        say(f"  labelled {length} tokens in {seconds[-1]:.1f} s")
    budget.label_tps = length / max(seconds[-1], 1e-6)

    size = options.draft_vocab if options.draft_vocab != "auto" else PROBE_DRAFT_VOCAB
    size = min(size, c.vocab_size)
    config = MTPConfig(
        hidden_size=c.hidden_size,
        intermediate_size=options.intermediate_size or c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=size,
        rms_norm_eps=c.rms_norm_eps,
        num_blocks=options.num_blocks,
        k=options.k,
    )
    head = MTPHead(config).to(options.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    embedding = target.embed_tokens.weight.detach().to(options.device)
    to_draft = torch.full((c.vocab_size,), IGNORE, dtype=torch.long, device=options.device)
    to_draft[:size] = torch.arange(size, device=options.device)
    labels = copy.copy(labels)
    for name in ("hidden", "tokens", "argmax", "remaining", "starts"):
        setattr(labels, name, getattr(labels, name).to(options.device))
    weights = torch.ones(options.k, device=options.device)
    times: list[float] = []
    while len(times) < 1 + PROBE_STEPS and sum(times) < PROBE_SECONDS:
        began = time.perf_counter()
        draw = torch.randint(len(labels.starts), (options.batch_size,), generator=generator)
        batch = origin_batch(labels, labels.starts[draw.to(options.device)], embedding, options.k)
        logits = head(batch.h, batch.embs, None)
        loss = weighted_loss(*draft_losses(logits, batch, labels, to_draft, None, False), weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    budget.step_s = min(times[1:] or times)  # a slow first step is taken as it is


def draft_cost(head: MTPHead, target: Transformer, repeats: int = 10) -> dict:
    """A draft step of `head` at batch 1 against one single-token forward of the target, both
    on the eager (PyTorch) model, best of `repeats` each: what drafting costs relative to
    decoding (an exported bundle has its own ratio; mtp-bench measures that)."""
    from mtp_edge.runtime.mtp_drafter import eager_step_fn, measure_step_cost
    from mtp_edge.runtime.session import EagerSession

    head = copy.deepcopy(head).cpu().to(target.dtype).eval()
    session = EagerSession(target, max(64, target.max_seq_len))
    with torch.inference_mode():
        return measure_step_cost(
            eager_step_fn(head, target), session, target.config.hidden_size, target.dtype, repeats
        )
