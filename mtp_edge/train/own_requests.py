"""Requests the target writes itself (Magpie: sampled from the start of a user turn of its own
chat template), cached next to --out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from mtp_edge.checkpoints import LoadedModel
from mtp_edge.errors import UserError
from mtp_edge.model import Transformer
from mtp_edge.mtp import target_fingerprint
from mtp_edge.train import generate as generation

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
    bar = generation.writing_bar(count, "writing requests", "request", len(requests))
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
            outs = generation.generate_batch(
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


def request_stream(loaded, seed, first, path, progress, writer, batch, stop, patience):
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
