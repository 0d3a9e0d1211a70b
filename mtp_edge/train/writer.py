"""The target writing its own training text: batched (int8) generation, its requests, the cache."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mtp_edge.checkpoints import LoadedModel
from mtp_edge.errors import UserError
from mtp_edge.logs import progress_bar
from mtp_edge.model import KVCache, Transformer
from mtp_edge.mtp import target_fingerprint
from mtp_edge.train.budget import SELF_WRITTEN_SHARE, Budget, minutes_left
from mtp_edge.train.corpus import (
    Sequence,
    chat_sequences,
    kinded_prompts,
    offline_texts,
    text_sequences,
)
from mtp_edge.train.options import TrainOptions, artifact_paths


def _writing_bar(total: int, desc: str, unit: str, initial: int):
    """A progress bar of the text written, shown by the first process of a distributed run."""
    later = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
    initial = initial if total is None else min(initial, total)
    return progress_bar(total, desc, unit=unit, initial=initial, disable=later)


def _batched_forward(model: Transformer, tokens, cols, offsets, key_ok, caches) -> torch.Tensor:
    """Transformer.forward with a batch dimension: tokens [B, T] at cache columns `cols` [T],
    each row's text starting at column offsets[b]; returns the last column's logits [B, V].

    A query sees the columns up to its own that hold its row's text; a padding query sees only
    itself, so that no row of the attention is empty (an empty row would be NaN, and NaN values
    poison even masked-out keys).
    """
    end = int(cols[-1]) + 1
    positions = (cols[None, :] - offsets[:, None]).clamp(min=0)
    cos, sin = model.rope_cos[positions][:, None], model.rope_sin[positions][:, None]
    keys = torch.arange(end)
    causal = keys[None, None, :] <= cols[None, :, None]
    itself = keys[None, None, :] == cols[None, :, None]
    mask = (causal & (key_ok[:, None, :end] | itself))[:, None]
    with _batch_caches(model, caches):
        hidden = model.hidden_states(tokens, cols, cos, sin, mask, end)
    return model.logits(hidden[:, -1])


@contextmanager
def _batch_caches(model: Transformer, caches):
    """Each layer attends through the batch's (K, V) in `caches` [B, KVH, S, hd] instead of the
    model's own cache, for the duration of the `with` block."""
    own = [layer.self_attn.cache for layer in model.layers]
    try:
        for layer, (k, v) in zip(model.layers, caches, strict=True):
            layer.self_attn.cache = KVCache.over(k, v)
        yield
    finally:
        for layer, cache in zip(model.layers, own, strict=True):
            layer.self_attn.cache = cache


class Int8Linear(nn.Module):
    """x W^T (+ b) with W in int8 per output row and each row of x quantized as it comes
    (dynamic, symmetric), multiplied in int8 by torch._int_mm (VNNI/AMX where the CPU has
    them). For writing and labelling training text (--writer, --labeller int8)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight_t", (w / scale[:, None]).round().to(torch.int8).t())
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        step = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        q = (rows / step).round().to(torch.int8)
        # Scaled in place: the same values as (y * step) * scale, without two more tensors of
        # the output's size (an LM head's is [rows, vocabulary]: 20% of its time at 64 rows).
        y = torch._int_mm(q, self.weight_t).float()
        y.mul_(step).mul_(self.scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


class Int8Transformer(Transformer):
    """What int8_writer returns: its LM head is an Int8Linear, which has no float weight for
    Transformer.logits to multiply by."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def int8_writer(model: Transformer) -> Transformer:
    """A copy of `model` whose linear layers and LM head are Int8Linear: batched greedy
    writing ~3x faster than fp32 on a 2-core x86 CPU (benchmarks/README.md, "Writing the
    text"). Shares every other tensor with `model`, so it costs a quarter of the linears'
    memory, not a second model."""
    shared = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    shared.append(model.embed_tokens.weight)
    writer = copy.deepcopy(model, {id(p): p for p in shared})
    for module in list(writer.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    if writer.lm_head is None:
        writer.lm_head = Int8Linear(model.embed_tokens.weight)
    writer.__class__ = Int8Transformer  # the same modules; only `logits` differs
    return writer


@torch.inference_mode()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    ended: list[bool] | None = None,
    on_step: Callable[[int], bool] | None = None,
) -> list[list[int]]:
    """Greedy (or, with a temperature, sampled) continuations of several prompts at once (eos
    left out; `ended`, if given, receives whether each row stopped at eos). `on_step`, if
    given, hears the tokens each decoding step added and answers whether to stop there (a
    deadline): the rows keep what they wrote so far, a prefix of their full continuation.

    One decode step reads the weights once for the whole batch, which is what makes writing a
    self-distillation corpus affordable on a CPU. Prompts are left-padded to a common length.
    """
    c = model.config
    longest = max(map(len, prompts))
    total = longest + max_new
    if model.max_seq_len < total:
        model.setup_cache(total)
    offsets = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt)
    key_ok = torch.arange(total)[None, :] >= offsets[:, None]
    shape = (len(prompts), c.num_kv_heads, total, c.head_dim)
    caches = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in model.layers
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    rows = list(range(len(prompts)))  # the prompt each batch row writes
    cols = torch.arange(longest)
    for step in range(max_new):
        if step == 0:  # prompts one at a time: padded together, attention would cost B x T^2
            first = []
            for b, start in enumerate(offsets.tolist()):
                first.append(
                    _batched_forward(
                        model,
                        tokens[b : b + 1, start:],
                        cols[start:],
                        offsets[b : b + 1],
                        key_ok[b : b + 1],
                        [(k[b : b + 1], v[b : b + 1]) for k, v in caches],
                    )
                )
                if on_step is not None and on_step(0):  # the deadline came while prefilling
                    if ended is not None:
                        ended[:] = [False] * len(prompts)
                    return outputs
            logits = torch.cat(first)
        else:
            logits = _batched_forward(model, tokens, cols, offsets, key_ok, caches)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            chosen = logits.argmax(-1)
        added = 0
        for row, token in zip(rows, chosen.tolist(), strict=True):
            if not done[row]:
                done[row] = token in eos_ids
                if not done[row]:
                    outputs[row].append(token)
                    added += 1
        if all(done) or (on_step is not None and on_step(added)):
            break
        tokens, cols = chosen[:, None], cols[-1:] + 1
        finished = sum(done[row] for row in rows)
        if finished * 4 >= len(rows):  # drop finished rows: they would cost as much as the rest
            keep = torch.tensor([i for i, row in enumerate(rows) if not done[row]])
            rows = [rows[i] for i in keep.tolist()]
            tokens, offsets, key_ok = tokens[keep], offsets[keep], key_ok[keep]
            caches = [(k[keep], v[keep]) for k, v in caches]
    if ended is not None:
        ended[:] = done
    return outputs


# Without --minutes and without --self-prompt-tokens: response tokens to self-written requests
# per template response token (about SELF_WRITTEN_SHARE of the writing time, as they cost more).
SELF_WRITTEN_PER_TEMPLATE = 0.25
# Rounds in a row without a usable request after which the default gives up on them (a model
# that cannot write requests: tiny or base models); --self-prompt-tokens insists.
AUTOMATIC_PATIENCE = 3


def self_written_requests(
    loaded: LoadedModel,
    count: int,
    seed: int,
    path: Path,
    progress: Callable[[str], None],
    writer,
    batch: int = 16,
    stop: Callable[[], bool] | None = None,
    patience: int | None = None,
) -> list[str]:
    """`count` distinct user requests the target writes itself: its chat template up to the
    start of a user message, continued by sampling (temperature 1) until the turn ends
    (Magpie, Xu et al. 2024). Requests cut off by the length limit, very short or repeated
    ones are dropped. Kept in `path` (keyed by model and seed) so reruns reuse them. Written
    by `writer`: an eager model (int8_writer or the target) in batches, or an exported target's
    session one at a time.

    Fewer come back when `stop()` turns true between rounds (a deadline), or, with `patience`,
    after that many rounds in a row without a usable request (a model that cannot write them:
    the caller goes on without; without `patience` that is an error after 50 rounds)."""
    from mtp_edge.runtime.loop import GenerationConfig, generate
    from mtp_edge.runtime.sampling import SamplingParams

    tokenizer = loaded.tokenizer
    if tokenizer.chat_template is None:
        raise UserError(
            f"{loaded.name} has no chat template, so it cannot write requests of its own: "
            "drop --self-prompt-tokens or give text with --data"
        )
    marker = "\x00request\x00"
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    prefix = prefix[: prefix.index(marker)]
    key = f"{loaded.name}:{target_fingerprint(loaded.model)[:16]}:{seed}"
    requests: list[str] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("key") == key:
                requests.append(entry["request"])
    seen = set(requests)
    ids = tokenizer.encode(prefix)
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    generator = torch.Generator().manual_seed(seed * 7919 + len(requests))
    barren = 0
    bar = _writing_bar(count, "writing requests", "request", len(requests))
    while len(requests) < count and not (stop is not None and stop()):
        if patience is not None and barren == patience:
            progress(
                f"{loaded.name} wrote no usable request in {patience} rounds (each must end its "
                "turn, have 4 words or more and be new): the template prompts only"
            )
            break
        if barren == 50:
            raise UserError(
                f"{loaded.name} wrote no usable request in 50 rounds (each must end its turn, "
                "have 4 words or more and be new): drop --self-prompt-tokens or give text with "
                "--data"
            )
        ended: list[bool] = []
        if isinstance(writer, Transformer):
            outs = generate_batch(
                writer, [ids] * batch, 96, tokenizer.eos_ids, 1.0, generator, ended
            )
        else:
            outs = []
            for _ in range(batch):
                draw = int(torch.randint(0, 2**31 - 1, (), generator=generator))
                config = GenerationConfig(
                    max_new_tokens=96,
                    k=0,
                    eos_ids=tuple(tokenizer.eos_ids),
                    sampling=SamplingParams(temperature=1.0, seed=draw),
                )
                result = generate(writer, ids, None, config)
                outs.append(result.token_ids)
                ended.append(result.stop_reason == "eos")
        new = []
        for out, stopped in zip(outs, ended, strict=True):
            text = tokenizer.decode(out).strip()
            if stopped and len(text.split()) >= 4 and text not in seen:
                seen.add(text)
                new.append(text)
        with open(path, "a") as f:
            f.writelines(
                json.dumps({"key": key, "request": t}, ensure_ascii=False) + "\n" for t in new
            )
        requests += new
        barren = 0 if new else barren + 1
        bar.update(min(len(requests), count) - bar.n)
    bar.close()
    progress(f"the target's requests: {min(count, len(requests))}")
    return requests[:count]


def generate_with_session(
    session, prompts: list[list[int]], max_new: int, eos_ids, on_step=None
) -> list:
    """Greedy continuations (eos left out), one prompt at a time through an exported target;
    `on_step` as in generate_batch, heard once per response (the rest are then left out)."""
    from mtp_edge.runtime.loop import GenerationConfig, generate

    config = GenerationConfig(max_new_tokens=max_new, k=0, eos_ids=tuple(eos_ids))
    outputs = []
    for prompt in prompts:
        room = session.max_seq_len - len(prompt)
        if room < 1:
            outputs.append([])
            continue
        config.max_new_tokens = min(max_new, room)
        ids = generate(session, prompt, None, config).token_ids
        outputs.append([t for t in ids if t not in eos_ids])
        if on_step is not None and on_step(len(outputs[-1])):
            break
    return outputs + [[] for _ in prompts[len(outputs) :]]


def open_target_bundle(path: str, loaded: LoadedModel):
    """The target session of an ExecuTorch bundle of `loaded`, and the hash that names the text
    it writes (the exported file's, so that text from the eager model is not reused)."""
    from mtp_edge.runtime.bundle import open_bundle, target_session

    bundle = open_bundle(path)
    m = bundle.manifest
    if m.model_name != loaded.name or m.vocab_size != loaded.config.vocab_size:
        raise UserError(f"--bundle {path} holds {m.model_name}, not the target {loaded.name}")
    methods = m.models["target"].methods
    outputs = [o["name"] for o in methods["forward"]["outputs"]]
    if "hidden" not in outputs and "last_hidden" not in methods:  # older programs: forward's
        raise UserError(
            f"--bundle {path} does not return hidden states: export it with --drafter mtp"
        )
    return target_session(bundle), "bundle-" + m.models["target"].sha256[:16]


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
    automatic = options.self_prompt_tokens is None
    if frozen:
        limits = list(frozen)
    elif automatic and loaded.tokenizer.chat_template is None:
        limits = [options.response_tokens(), 0]  # a model without chat turns: templates only
    elif automatic:
        templates = options.response_tokens()
        limits = [templates, None if timed else round(templates * SELF_WRITTEN_PER_TEMPLATE)]
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
        requests = _request_stream(
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
    if budget is not None:
        budget.written_text = written
    return sequences + own


def _request_stream(loaded, seed, first, path, progress, writer, batch, stop, patience):
    """("self-written", request) pairs, the requests written in rounds as they are asked for
    (self_written_requests: cached, so a rerun reads them back); ends when no more come (a
    deadline, or a model that cannot write them within `patience` rounds)."""
    count, given = first, 0
    while True:
        requests = self_written_requests(
            loaded, count, seed, path, progress, writer, batch, stop, patience
        )
        if len(requests) <= given:
            return
        for request in requests[given:]:
            yield "self-written", request
        given, count = len(requests), max(count * 3 // 2, len(requests) + batch)


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
) -> list[Sequence]:
    """Responses to `prompts` until `limit` response tokens (None: no limit) or, with a
    `budget`, its writing deadline: a batch cut by the deadline keeps what it wrote (each row a
    prefix of its greedy response, as --gen-max-new cuts them too). `replay`: only the cached
    responses, as a --minutes run that stopped writing read them (a resumed run's text). A
    finite stream of prompts ends the writing when it runs out. Returns the sequences and their
    response tokens."""
    path = artifact_paths(options.out)["generated"]
    cached = _read_generated(path, target_hash)
    tokenizer = loaded.tokenizer
    seen: set[str] = set()  # template prompts repeat; a repeat would leak into the held-out set
    kinds: dict[str, str] = {}
    sequences: list[Sequence] = []
    total = 0
    wanted = float("inf") if limit is None else limit
    bar = _writing_bar(limit, "writing responses", "tok", 0)

    def step(added: int) -> bool:
        """Tokens written by a decoding step (or a whole batch): the bar, the budget."""
        bar.update(added)
        if budget is None:
            return False
        over = budget.wrote(added)
        left = minutes_left(budget.writing_deadline(), budget.clock)
        if left:
            bar.set_postfix_str(left, refresh=False)
        return over

    exhausted = False
    while total < wanted and not exhausted and not (budget and budget.writing_over()):
        batch = []
        while len(batch) < options.gen_batch * world and not exhausted:
            try:
                kind, prompt = next(prompts)
            except StopIteration:
                exhausted = True
                break
            ids = tokenizer.encode_prompt(prompt)
            if prompt not in seen and len(ids) <= options.seq_len:
                seen.add(prompt)
                kinds[prompt] = kind
                batch.append((prompt, ids))
        if not batch:
            break
        todo = [(p, ids) for p, ids in batch if p not in cached]
        if replay and len(todo) == len(batch):
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
            # batch is counted when it is done.
            timed = budget is not None and budget.writing_until < math.inf
            prompt_ids, longest = [ids for _, ids in mine], options.gen_max_new
            if eager and timed:
                outs = generate_batch(writer, prompt_ids, longest, tokenizer.eos_ids, on_step=step)
            elif eager:
                outs = generate_batch(writer, prompt_ids, longest, tokenizer.eos_ids)
            else:
                outs = generate_with_session(
                    writer, prompt_ids, longest, tokenizer.eos_ids, step if timed else None
                )
            if not timed:
                step(sum(map(len, outs)))
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
        if not cut and not any(cached.get(p, {}).get("response_ids") for p, _ in batch):
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
