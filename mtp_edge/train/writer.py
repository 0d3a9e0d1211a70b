"""The text the target writes: its answers to the template prompts, to the requests it writes
itself (own_requests.py) and to the user's requests (--prompts), appended to a cache next to
--out as they are made, so an interrupted run or a rerun continues where it stopped."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mtp_edge.checkpoints import LoadedModel
from mtp_edge.errors import UserError
from mtp_edge.model import Transformer
from mtp_edge.train import generate as generation
from mtp_edge.train.budget import SELF_WRITTEN_SHARE, Budget, minutes_left
from mtp_edge.train.corpus import (
    Sequence,
    chat_sequences,
    kinded_prompts,
    offline_texts,
    text_sequences,
)
from mtp_edge.train.int8 import int8_writer
from mtp_edge.train.options import TrainOptions, artifact_paths
from mtp_edge.train.own_requests import AUTOMATIC_PATIENCE, request_stream
from mtp_edge.train.prompts import YOURS, encode_request, request_key

# Without --minutes and without --self-prompt-tokens: response tokens to self-written requests
# per template response token (about SELF_WRITTEN_SHARE of the writing time, as they cost more).
SELF_WRITTEN_PER_TEMPLATE = 0.25
# The temperature of the answers after the first (--answers-per-request): near the greedy
# answer's phrasing, varied enough to be more text.
ANSWER_TEMPERATURE = 0.7


def _read_generated(path: Path, target_hash: str) -> dict[str, dict]:
    if not path.is_file():
        return {}
    cached = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by an interruption
        if entry.get("target") == target_hash:
            cached[entry["prompt"]] = entry
    return cached


def generated_sequences(
    loaded: LoadedModel,
    options: TrainOptions,
    target_hash: str,
    rank: int,
    world: int,
    progress: Callable[[str], None],
    writer,
    budget: Budget | None = None,
) -> list[Sequence]:
    """Prompt + the target's greedy response: to template prompts over the offline material,
    until `gen_tokens` response tokens, and to requests the target writes itself, until
    `self_prompt_tokens` (or, with a `budget`, until its writing deadline, the self-written
    requests taking SELF_WRITTEN_SHARE of the writing time first), written by `writer` (an
    eager model in batches, or an exported target's session one at a time).

    Responses are appended to the cache file as they are made, so an interrupted run (or any
    later run with the same target and seed) continues where it stopped.
    """
    # A resumed --minutes run whose writing had ended reads back exactly the text it wrote.
    frozen = budget.frozen_text if budget is not None else None
    timed = None if frozen else budget
    # A deadline (--minutes) rather than the stages' clock alone: writing runs until it, not
    # until token counts (with the clock alone, a count-less kind of text would never end).
    deadline = timed is not None and not math.isinf(timed.total_s)
    automatic = options.self_prompt_tokens is None
    yours: list[Sequence] = []
    if options.requests:  # the user's requests first: what the heads will draft for
        yours, mine = _answers_to_yours(
            loaded, options, target_hash, rank, world, progress, writer, timed, frozen, deadline
        )
        if frozen:
            frozen = frozen[:2]
    if frozen:
        limits = list(frozen)
    elif options.requests:  # the rest of the text: templates (self-written requests if asked)
        rest = None if deadline else max(0, options.response_tokens() - mine)
        limits = [rest, 0 if automatic else options.self_prompt_tokens]
    elif automatic and loaded.tokenizer.chat_template is None:
        limits = [options.response_tokens(), 0]  # a model without chat turns: templates only
    elif automatic:
        templates = options.response_tokens()
        limits = [templates, None if deadline else round(templates * SELF_WRITTEN_PER_TEMPLATE)]
    else:
        limits = [options.response_tokens(), options.self_prompt_tokens]
    own: list[Sequence] = []
    written = [0, 0]
    if limits[1] != 0:
        if timed is not None:  # the self-written requests' share of the writing time
            timed.writing_share = SELF_WRITTEN_SHARE
        path = artifact_paths(options.out)["requests"]
        # About one request per 150 response tokens; more are written if they run out.
        first = limits[1] // 150 + 16 if limits[1] else options.gen_batch
        requests = request_stream(
            loaded, options.seed, first, path, progress, writer, options.gen_batch,
            stop=timed.writing_over if timed else None,
            patience=AUTOMATIC_PATIENCE if automatic and not frozen else None,
        )  # fmt: skip
        own, written[1] = _responses(
            loaded, options, target_hash, rank, world, progress, writer,
            requests, limits[1], timed, frozen is not None,
        )  # fmt: skip
        if timed is not None:
            timed.writing_share = 1.0
    sequences, written[0] = _responses(
        loaded, options, target_hash, rank, world, progress, writer,
        kinded_prompts(options.seed), limits[0], timed, frozen is not None,
    )  # fmt: skip
    if options.requests:
        written.append(mine)
    if budget is not None:
        budget.written_text = written
    return sequences + own + yours


def _answers_to_yours(
    loaded, options, target_hash, rank, world, progress, writer, timed, frozen, deadline
):
    """The target's answers to the user's requests (--prompts): --prompts-share of the response
    tokens, or of the writing time under --minutes (or, resumed, what an earlier run wrote).
    Requests longer than the training sequences are left out (_responses), and said so: with
    none left, the run would train on the default text alone, so it stops first."""
    _check_lengths(loaded.tokenizer, options, progress)
    if frozen:
        limit = frozen[2] if len(frozen) > 2 else 0
    elif deadline:
        limit = None
        timed.writing_share = options.prompts_share
    else:
        limit = round(options.prompts_share * options.response_tokens())
    stream = ((YOURS, request) for request in options.requests)
    yours, mine = _responses(
        loaded, options, target_hash, rank, world, progress, writer,
        stream, limit, timed, frozen is not None,
    )  # fmt: skip
    answered = len(yours)
    # Sampled answers after the greedy ones, a round over the requests at a time, while the
    # share has room (a resumed run reads back those it wrote, and no more).
    for sample in range(1, options.answers_per_request):
        if (limit is not None and mine >= limit) or (timed is not None and timed.writing_over()):
            break
        stream = ((YOURS, request) for request in options.requests)
        more, wrote = _responses(
            loaded, options, target_hash, rank, world, progress, writer, stream,
            None if limit is None else limit - mine, timed, frozen is not None, sample=sample,
        )  # fmt: skip
        yours, mine = yours + more, mine + wrote
        if not more:
            break
    if timed is not None:
        timed.writing_share = 1.0
    sampled = f" (+{len(yours) - answered} sampled answers)" if len(yours) > answered else ""
    progress(
        f"answers to your requests: {answered} of {len(options.requests)}{sampled}, {mine} tokens"
    )
    return yours, mine


def _check_lengths(tokenizer, options, progress) -> None:
    """Say how many of the user's requests are too long to train on; none usable is an error."""
    lengths = [len(encode_request(tokenizer, request)) for request in options.requests]
    too_long = sum(n > options.seq_len for n in lengths)
    if not too_long:
        return
    asked = len(options.requests)
    if too_long == asked:
        which = "the request is" if asked == 1 else f"all {asked} requests are"
        raise UserError(
            f"--prompts {options.prompts}: {which} longer than the training sequences "
            f"({options.seq_len} tokens; the shortest has {min(lengths)}): give shorter requests"
        )
    progress(
        f"skipped {too_long} of {asked} of your requests, longer than the training sequences "
        f"({options.seq_len} tokens)"
    )


# Prompts passed over in a row (repeats, or too long for the training sequences) after which
# the writing stops rather than drawing forever from an endless stream.
PASSED_OVER_LIMIT = 5000


def _responses(
    loaded,
    options,
    target_hash,
    rank,
    world,
    progress,
    writer,
    prompts,
    limit,
    budget=None,
    replay: bool = False,
    sample: int = 0,
) -> list[Sequence]:
    """Responses to `prompts` until `limit` response tokens (None: no limit) or, with a
    `budget`, its writing deadline: a batch cut by the deadline keeps what it wrote (each row a
    prefix of its greedy response, as --gen-max-new cuts them too). `replay`: only the cached
    responses, as a --minutes run that stopped writing read them (a resumed run's text). A
    finite stream of prompts ends the writing when it runs out. `sample` > 0: the sample-th
    answer sampled at ANSWER_TEMPERATURE (seeded by --seed and `sample`) instead of the greedy
    one, cached under its own key; replayed, a round ends quietly where the earlier run
    stopped. Returns the sequences and their response tokens."""
    path = artifact_paths(options.out)["generated"]
    cached = _read_generated(path, target_hash)
    tokenizer = loaded.tokenizer
    seen: set[str] = set()  # template prompts repeat; a repeat would leak into the held-out set
    kinds: dict[str, str] = {}
    sequences: list[Sequence] = []
    total = 0
    wanted = float("inf") if limit is None else limit
    bar = generation.writing_bar(limit, "writing responses", "tok", 0)

    read = [0, 0]  # prompts of the batch prefilled, of how many (a batch starts with them)
    sampling = {}
    if sample:
        seed = options.seed * 1_000_003 + sample
        sampling = {"temperature": ANSWER_TEMPERATURE,
                    "generator": torch.Generator().manual_seed(seed)}  # fmt: skip
    groups: dict[str, str] = {}  # cache key -> the request's own key

    def shown(added: int) -> bool:
        """Tokens written by a decoding step: the bar only (no deadline to stop on)."""
        if added == 0 and read[0] < read[1]:  # a prompt read: progress before the first token
            read[0] += 1
            bar.set_postfix_str(f"read {read[0]}/{read[1]} prompts of the batch")
        bar.update(added)
        return False

    def step(added: int) -> bool:
        """Tokens written by a decoding step (or a whole batch): the bar, the budget."""
        shown(added)
        if budget is None:
            return False
        over = budget.wrote(added)
        left = minutes_left(budget.writing_deadline(), budget.clock)
        if left:
            bar.set_postfix_str(left, refresh=False)
        return over

    exhausted = False
    passed = 0  # prompts passed over in a row: an endless stream may offer none that fits
    while total < wanted and not exhausted and not (budget and budget.writing_over()):
        batch = []
        while len(batch) < options.gen_batch * world and not exhausted:
            try:
                kind, request = next(prompts)
            except StopIteration:
                exhausted = True
                break
            group, ids = request_key(request), encode_request(tokenizer, request)
            prompt = group if not sample else f"{group}\x00sample {sample}"
            if prompt not in seen and len(ids) <= options.seq_len:
                seen.add(prompt)
                kinds[prompt] = kind
                groups[prompt] = group if kind == YOURS else ""
                batch.append((prompt, ids))
                passed = 0
            elif (passed := passed + 1) >= PASSED_OVER_LIMIT:
                progress(
                    f"stopped writing: the last {PASSED_OVER_LIMIT} prompts were repeats or "
                    f"longer than the training sequences ({options.seq_len} tokens)"
                )
                exhausted = True
        if not batch:
            break
        todo = [(p, ids) for p, ids in batch if p not in cached]
        ended = replay and sample and bool(todo)  # the earlier run's sampled answers end here
        exhausted = exhausted or ended
        if replay and not sample and len(todo) == len(batch):
            raise UserError(
                f"the text an earlier run wrote is gone from {path}: rerun without --resume"
            )
        if replay:
            todo = []
        mine = todo[rank::world]
        mine.sort(key=lambda item: len(item[1]))  # similar lengths pad less
        responses, cut = [], False
        if mine:
            eager = isinstance(writer, Transformer)
            if budget is not None:
                budget.writer_starts()
            # Under a deadline, every decoding step counts (and may stop the batch); else the
            # steps move the bar and the batch is counted when it is done.
            timed = budget is not None and budget.writing_until < math.inf
            prompt_ids, longest = [ids for _, ids in mine], options.gen_max_new
            read[:] = [0, len(mine) if eager else 0]
            write = generation.generate_batch if eager else generation.generate_with_session
            if sampling and not eager:
                raise UserError(
                    "--answers-per-request above 1 samples answers, which the exported "
                    "target's writer does not: give --writer fp32 or int8"
                )
            outs = write(
                writer, prompt_ids, longest, tokenizer.eos_ids,
                on_step=step if timed else shown, **sampling,
            )  # fmt: skip
            if not timed and budget is not None:
                budget.wrote(sum(map(len, outs)))
            cut = budget is not None and budget.writing_over()
            if budget is not None:
                budget.wrote_batch(sum(len(ids) for _, ids in mine), sum(map(len, outs)))
            responses = [
                {
                    "target": target_hash,
                    "prompt": p,
                    "prompt_ids": ids,
                    "response_ids": out,
                    "response": tokenizer.decode(out),
                }
                for (p, ids), out in zip(mine, outs, strict=True)
                if out or not cut  # a row the deadline cut before it began is not an answer
            ]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, responses)
            responses = [entry for part in gathered for entry in part]
        if rank == 0 and responses:
            with open(path, "a") as f:
                f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in responses)
        for entry in responses:
            cached[entry["prompt"]] = entry
        if (
            not cut
            and not ended
            and not any(cached.get(p, {}).get("response_ids") for p, _ in batch)
        ):
            raise UserError(
                f"{loaded.name} ended every response at once (eos first): it cannot write its own "
                "training text; give text files with --data"
            )
        new_prompts = {p for p, _ in mine}
        for prompt, _ in batch:
            entry = cached.get(prompt)
            if entry and entry["response_ids"] and total < wanted:
                sequences.append(
                    Sequence(
                        entry["prompt_ids"] + entry["response_ids"],
                        len(entry["prompt_ids"]) - 1,
                        kinds[prompt],
                        groups[prompt],
                    )
                )
                total += len(entry["response_ids"])
                if budget is not None and prompt not in new_prompts:
                    budget.text_reused(len(entry["response_ids"]))
        bar.update(min(total, wanted) - bar.n)  # the text kept (decoding steps counted more)
    bar.close()
    progress(f"the target's responses: {total} tokens")
    return sequences, total


def build_corpus(
    loaded: LoadedModel,
    options: TrainOptions,
    target_hash: str,
    rank: int,
    world: int,
    progress: Callable[[str], None],
    writer=None,
    budget: Budget | None = None,
) -> list[Sequence]:
    """The training text. `writer` writes the responses (generated_sequences); by default the
    eager target as --writer says (int8 or fp32). With a `budget`, writing stops on its
    deadline (user text is not written, so the budget does not touch it)."""
    rng = random.Random(options.seed)
    if options.data:
        texts, chats = [], []
        for name in options.data:
            if name.endswith((".jsonl", ".jsonl.gz")):
                tokenizer, longest = loaded.tokenizer, options.gen_max_new
                chats += chat_sequences(name, tokenizer, options.seq_len, longest)
                continue
            try:
                texts.append(Path(name).read_text(errors="replace"))
            except OSError as e:
                raise UserError(f"cannot read --data {name}: {e.strerror}") from None
        sequences = text_sequences(texts, loaded.tokenizer, options.seq_len, None, rng) + chats
    else:
        offline = options.raw_tokens
        if budget is not None:
            offline = budget.offline_tokens(options.batch_size, offline)
        sequences = text_sequences(
            offline_texts(), loaded.tokenizer, options.seq_len, offline, rng, "offline"
        )
        if writer is None:
            writer = int8_writer(loaded.model) if options.writer == "int8" else loaded.model
        if budget is not None and budget.frozen_text is None:
            offline = sum(len(s.tokens) for s in sequences)
            budget.start_writing(options.batch_size, offline)
            if budget.writing_until < math.inf:
                progress(f"writing for up to {budget.writing_until - budget.clock():.0f} s")
        sequences += generated_sequences(
            loaded, options, target_hash, rank, world, progress, writer, budget
        )
    return sequences
