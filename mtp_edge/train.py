"""mtp-train: MTP heads for a target that has none, by self-distillation from the frozen target.

Four stages, each a plain function:
1. corpus: the user's text files; or offline text (the Python docs that ship with the interpreter
   and stdlib sources) plus responses the target writes itself to instruction prompts built from
   that material. What the head must predict is what the target says, so the target's own
   writing is the best data; the responses are cached next to --out and never regenerated.
2. labels: the frozen target, teacher-forced over each sequence: per position its final hidden
   state and its argmax next token.
3. draft vocabulary: the tokens the target predicts most often (the head's LM head covers only
   these, which keeps a draft step cheap).
4. training-time test (EAGLE-3): whole sequences at once; from every position, k unrolled steps
   on the head's own hidden state (and, for heads that read the target's cache, attention over
   the target's last-layer K/V plus the head's own K/V of the earlier steps, as drafting writes
   them), each scored against the target's distribution over the draft vocabulary (soft labels;
   `--labels hard`: its argmax); early steps weigh more, as a later draft only counts when the
   earlier ones were accepted.

Runs under `torchrun --nproc_per_node=N` (gloo): ranks share the generation, label and train on
their own shard of sequences, and DistributedDataParallel averages the gradients. Only rank 0
writes files.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mtp_edge.checkpoints import LoadedModel, load_model
from mtp_edge.errors import UserError
from mtp_edge.model import KVCache, Transformer, rope_frequencies
from mtp_edge.mtp import (
    MTPConfig,
    MTPHead,
    TrainContext,
    cache_attention_config,
    carry_vocabulary,
    init_from_target,
    load_heads,
    save_heads,
    target_fingerprint,
    target_lm_head,
    write_atomically,
)

IGNORE = -100  # label of a position the loss skips (outside the draft vocabulary, or past the end)


@dataclass
class TrainOptions:
    out: str = "heads.safetensors"
    model: str = "default"
    data: tuple[str, ...] = ()  # text files; empty: offline text + the target's own responses
    k: int = 4  # unrolled draft steps
    steps: int = 3000
    # Draft origins per step (per rank): drawn from anywhere in the text for heads without
    # attention, in whole sequences for heads with attention.
    batch_size: int = 512
    lr: float = 1e-3
    seed: int = 0
    resume: bool = False
    draft_vocab: int = 8192
    num_blocks: int = 1
    intermediate_size: int = 0  # 0: the target's
    # "none", "target_cache" or "self" (mtp.py; measured in README.md, "The MTP drafter")
    attention: str = "none"
    labels: str = "hard"  # hard: the target's argmax; soft: its distribution over the draft vocab
    # Weight of the hidden-state loss: each step's output hidden state regressed onto the
    # target's own hidden state at the position it stands in for (EAGLE's feature loss), meant
    # to keep step j+1's input like the target's. Off by default: with it (and the LM head
    # frozen) the head stopped memorising its text but learned the target's choices more slowly
    # (benchmarks/README.md, "MTP head training").
    feature_loss: float = 0.0
    train_lm_head: bool = True  # False: the draft LM head stays the target's rows, frozen
    gen_tokens: int = 100_000  # response tokens the target writes (default corpus only)
    # More response tokens, to requests the target writes itself (Magpie: sampled from the
    # start of a user turn of its own chat template): requests as varied as the model's own
    # idea of what users ask, beyond the templates over offline material.
    self_prompt_tokens: int = 0
    init: str | None = None  # heads to start from (their draft vocabulary and design too)
    gen_max_new: int = 256  # longest response
    gen_batch: int = 64  # prompts (and self-written requests) decoded together
    write_only: bool = False  # write the text (cached next to --out), then stop
    # Who writes the text: "int8" (the target with int8 linears, batched: the fastest on a
    # CPU), "fp32" (the target as loaded, batched), "bundle" (the exported target of --bundle,
    # one sequence at a time: exactly what will run, ~1.4x slower than int8). Default: the
    # bundle when one is given, else int8. Labels always come from the real target (the
    # bundle's when given). Measured agreement with the bundle's own greedy choices:
    # benchmarks/README.md, "Writing the text".
    writer: str = ""
    raw_tokens: int = 50_000  # tokens of offline text (default corpus only)
    seq_len: int = 512  # longest text sequence
    heldout: float = 0.05  # fraction of sequences held out for evaluation
    step_decay: float = 0.8  # loss weight of draft step j is step_decay ** (j - 1)
    weight_decay: float = 0.0
    warmup: int = 100
    log_every: int = 50
    eval_every: int = 500
    checkpoint_every: int = 500
    threads: int = 0  # 0: torch's default
    # An ExecuTorch bundle of the same target (exported with --drafter mtp, so that it returns
    # hidden states): it writes and labels the text instead of the eager model, so the heads
    # learn the exported (quantized) target's states and choices — what they will be run on.
    bundle: str | None = None

    def __post_init__(self):
        self.data = tuple(self.data)
        self.writer = self.writer or ("bundle" if self.bundle else "int8")
        checks = [
            (self.k >= 1, f"--k must be >= 1, got {self.k}"),
            (self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.draft_vocab >= 1, f"--draft-vocab must be >= 1, got {self.draft_vocab}"),
            (self.num_blocks >= 1, f"--num-blocks must be >= 1, got {self.num_blocks}"),
            (0 < self.heldout < 1, f"--heldout must be in (0, 1), got {self.heldout}"),
            (self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}"),
            (self.gen_batch >= 1, f"--gen-batch must be >= 1, got {self.gen_batch}"),
            (
                self.writer in ("int8", "fp32", "bundle"),
                f"--writer must be int8, fp32 or bundle, got {self.writer}",
            ),
            (
                self.writer != "bundle" or self.bundle is not None,
                "--writer bundle writes with the exported target: give it with --bundle",
            ),
            (
                min(self.gen_tokens, self.raw_tokens, self.self_prompt_tokens) >= 0,
                "token budgets must be >= 0",
            ),
            (
                self.attention in ("none", "target_cache", "self"),
                f"--attention must be none, target_cache or self, got {self.attention}",
            ),
            (self.labels in ("soft", "hard"), f"--labels must be soft or hard, got {self.labels}"),
            (self.feature_loss >= 0, f"--feature-loss must be >= 0, got {self.feature_loss}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    def recipe(self) -> dict:
        """What the heads file records about how it was made (file names, not local paths)."""
        values = asdict(self)
        for key in (
            "out",
            "resume",
            "threads",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "write_only",
        ):
            values.pop(key)
        values["model"] = Path(self.model).name
        values["bundle"] = Path(self.bundle).name if self.bundle else None
        values["data"] = [Path(p).name for p in self.data]
        values["init"] = Path(self.init).name if self.init else None
        return values


@dataclass
class Sequence:
    tokens: list[int]
    start: int  # first position a draft may start from (the last prompt token of a chat turn)


@dataclass
class Labels:
    """Per position of a set of sequences laid end to end."""

    hidden: torch.Tensor  # [N, D] float16: the target's final-normed hidden state
    tokens: torch.Tensor  # [N] the sequence's token
    argmax: torch.Tensor  # [N] the target's next-token argmax
    remaining: torch.Tensor  # [N] positions after this one in its sequence
    starts: torch.Tensor  # [M] positions a draft may start from
    bounds: torch.Tensor  # [S, 3] per sequence: offset, length, first draft origin (local)
    keys: torch.Tensor | None = None  # [N, KVH, hd] float16: the target's last-layer K (roped)
    values: torch.Tensor | None = None  # [N, KVH, hd] float16: and V


def artifact_paths(out: str | Path) -> dict[str, Path]:
    out = Path(out)
    return {
        "generated": out.with_name(out.stem + ".gen.jsonl"),
        "requests": out.with_name(out.stem + ".requests.jsonl"),  # the target's own requests
        "checkpoint": out.with_name(out.stem + ".ckpt.safetensors"),
        "labels": out.with_name(out.stem + ".labels"),  # + .<part><rank>.safetensors
        "checkpoint_json": out.with_name(out.stem + ".ckpt.json"),
    }


# --- 1. corpus -------------------------------------------------------------------------------

# Pure-Python stdlib modules: their docstrings and sources are prose and code that ship offline.
_STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions", "functools",
    "gettext", "glob", "heapq", "html", "ipaddress", "json", "json.decoder", "json.encoder",
    "logging", "operator", "optparse", "pathlib", "pprint", "queue", "random", "reprlib",
    "sched", "secrets", "shlex", "shutil", "statistics", "string", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "typing", "unittest.case", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


def _modules() -> list:
    found = []
    for name in _STDLIB_MODULES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def doc_topics() -> dict[str, str]:
    """pydoc_data.topics without the topics reserved for evaluation."""
    from pydoc_data.topics import topics

    from mtp_edge.quantize.quality import HELDOUT_TOPICS

    return {name: text for name, text in sorted(topics.items()) if name not in HELDOUT_TOPICS}


def offline_texts() -> list[str]:
    texts = list(doc_topics().values())
    for module in _modules():
        try:
            texts.append(inspect.getsource(module))
        except (OSError, TypeError):
            continue
    return texts


def text_sequences(
    texts: list[str], tokenizer, seq_len: int, budget: int | None, rng: random.Random
) -> list[Sequence]:
    """Blocks of about seq_len tokens, in random order, until `budget` tokens (None: all)."""
    blocks = []
    for text in texts:
        for i in range(0, len(text), seq_len * 3):  # about seq_len tokens of English or code
            blocks.append(text[i : i + seq_len * 3])
    if budget is not None:
        rng.shuffle(blocks)
    sequences, total = [], 0
    for block in blocks:
        if budget is not None and total >= budget:
            break
        ids = tokenizer.encode(block)[:seq_len]
        if len(ids) >= 2:
            sequences.append(Sequence(ids, 0))
            total += len(ids)
    return sequences


def chat_sequences(path: str, tokenizer, seq_len: int, max_new: int) -> list[Sequence]:
    """Prompt/response pairs from a JSON-lines file (optionally gzipped), one object per line
    with "prompt" and "response" strings: the prompt through the target's chat template (up
    to seq_len tokens; longer ones are skipped), the response after it (up to max_new tokens),
    drafted from where the response starts. `mtp-train --write-only` leaves such a file's
    content in <out>.gen.jsonl; data/ holds one the default target wrote."""
    opener = gzip.open if path.endswith(".gz") else open
    sequences = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    prompt, response = entry["prompt"], entry["response"]
                    if not isinstance(prompt, str) or not isinstance(response, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    raise UserError(
                        f'--data {path}, line {number}: expected a JSON object with "prompt" '
                        'and "response" strings'
                    ) from None
                ids = tokenizer.encode_prompt(prompt)
                answer = tokenizer.encode(response)[:max_new]
                if len(ids) <= seq_len and answer:
                    sequences.append(Sequence(ids + answer, len(ids) - 1))
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read --data {path}: {getattr(e, 'strerror', None) or e}") from None
    return sequences


@dataclass
class _Material:
    paragraphs: list[str]
    functions: list[tuple[str, str]]  # (qualified name, first docstring paragraph)
    snippets: list[str]  # short function sources
    topics: list[str]


def _material() -> _Material:
    paragraphs, topics = [], []
    for name, text in doc_topics().items():
        topics.append(name.replace("-", " "))
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 200 <= len(para) <= 1200:
                paragraphs.append(para)
    functions, snippets = [], []
    for module in _modules():
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc:
                functions.append((f"{module.__name__}.{name}", doc.split("\n\n")[0][:400]))
            if inspect.isfunction(obj):
                try:
                    source = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 4 <= source.count("\n") <= 30:
                    snippets.append(source)
    return _Material(paragraphs, functions, snippets, topics)


_ACTIVITIES = (
    "learning to cook", "running a first 10k", "keeping a plant alive", "studying for exams",
    "saving money", "starting a small garden", "learning a new language", "working from home",
    "sleeping better", "planning a trip", "speaking in public", "writing every day",
)  # fmt: skip
_SUBJECTS = (
    "a lighthouse keeper", "a robot that learns to paint", "a lost cat", "the last bookstore",
    "a city under the sea", "a clockmaker", "two rival chefs", "a winter storm", "a tiny dragon",
    "an old map", "the first day at a new school", "a friendly ghost",
)  # fmt: skip
_PEOPLE = (
    "a student", "a busy parent", "a retiree", "a beginner", "a teenager", "a teacher",
    "a nurse on night shifts", "someone who just moved to a new city",
)  # fmt: skip
_MOODS = ("funny", "sad", "hopeful", "mysterious", "calm", "exciting")
_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
_SENTENCES = (
    "The meeting has been moved to Thursday afternoon.",
    "Could you tell me where the train station is?",
    "I would like a cup of coffee and a glass of water, please.",
    "The weather is beautiful today, so we are going to the park.",
    "Please remember to close the windows before you leave.",
    "My brother is learning to play the guitar.",
    "We need to finish this report by the end of the week.",
    "The library opens at nine and closes at six.",
)
_ITEMS = ("apples", "notebooks", "tickets", "pencils", "cookies", "books", "plants", "shirts")

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "explain": (
        "Explain in simple terms what this part of the Python documentation says:\n\n{para}",
        "What is the main idea of the following passage? Explain it with an example.\n\n{para}",
        "Explain what this Python code does, step by step:\n\n{snippet}",
    ),
    "summarize": (
        "Summarize the following text in two or three sentences:\n\n{para}",
        "Give a one-sentence summary of this text:\n\n{para}",
        "Summarize this passage as three bullet points:\n\n{para}",
    ),
    "rewrite": (
        "Rewrite this paragraph so that a beginner can understand it:\n\n{para}",
        "Rewrite the following text in a more concise way:\n\n{para}",
        "Add comments to this Python function and suggest a clearer name for it:\n\n{snippet}",
    ),
    "qa": (
        "What does the Python function {func} do? Its documentation says: {doc}",
        "In Python, when would you use {func}?",
        "What is the difference between {func} and {func2} in Python?",
        "Answer briefly: what does the Python documentation mean by '{topic}'?",
    ),
    "code": (
        "Write a short Python example that uses {func}. Its documentation says: {doc}",
        "Write a Python function that {task}. Add a docstring and one usage example.",
        "Write unit tests with unittest for this function:\n\n{snippet}",
        "Find possible bugs or edge cases in this Python code and explain them:\n\n{snippet}",
    ),
    "math": (
        "A shop sells {item} for ${a} each. How much do {n} {item} cost? Show your steps.",
        "What is {a} * {b}? Explain how you computed it.",
        "Solve for x: {a}x + {b} = {c}. Show each step.",
        "What is {p}% of {c}? Show your reasoning.",
        "A train travels {a} km in {n} hours. What is its average speed?",
    ),
    "translate": (
        "Translate into {language}: {sentence}",
        "Translate this sentence from the Python documentation into {language}: {docline}",
        "Translate the following sentence into {language} and explain one word choice: {sentence}",
    ),
    "structured": (
        "Return a JSON object with the keys name, module and purpose for the Python function "
        "{func}. Its documentation says: {doc}",
        "List three facts about {topic} in Python as a numbered list.",
        "Make a markdown table with two columns, tip and reason, for {activity}.",
    ),
    "chat": (
        "Give me {n} tips for {activity} as {who}.",
        "I am {who} and I am nervous about {activity}. Any advice?",
        "Write a short, friendly email to {who} about {activity}.",
        "What are the pros and cons of {activity} for {who}?",
    ),
    "long-form": (
        "Write a short {mood} story about {subject}.",
        "Write a short essay about {activity} for {who}.",
        "Describe {subject} in a vivid, {mood} paragraph.",
    ),
}
_TASKS = (
    "reverses the words in a sentence", "counts the vowels in a string",
    "checks whether a number is prime", "merges two sorted lists",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping order",
    "parses a date in the form YYYY-MM-DD", "finds the most common word in a text",
    "flattens a nested list", "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome", "groups words by their first letter",
)  # fmt: skip


def instruction_prompts(seed: int) -> Iterator[str]:
    """An endless, seeded stream of instruction prompts over the offline material: the kinds of
    request a chat model gets (explain, summarize, rewrite, answer, code, math, translate,
    structured output, chat, long form)."""
    m = _material()
    rng = random.Random(seed)
    kinds = sorted(_TEMPLATES)
    while True:
        template = rng.choice(_TEMPLATES[rng.choice(kinds)])
        (func, doc), (func2, _) = rng.choice(m.functions), rng.choice(m.functions)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        yield template.format(
            para=rng.choice(m.paragraphs),
            snippet=rng.choice(m.snippets),
            func=func,
            func2=func2,
            doc=doc,
            docline=doc.split(". ")[0].rstrip(".") + ".",
            who=rng.choice(_PEOPLE),
            mood=rng.choice(_MOODS),
            topic=rng.choice(m.topics),
            task=rng.choice(_TASKS),
            activity=rng.choice(_ACTIVITIES),
            subject=rng.choice(_SUBJECTS),
            language=rng.choice(_LANGUAGES),
            sentence=rng.choice(_SENTENCES),
            item=rng.choice(_ITEMS),
            a=a,
            b=b,
            c=a * rng.randint(2, 9) + b,
            n=rng.randint(2, 12),
            p=rng.choice((5, 10, 15, 20, 25, 40, 75)),
        )


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
    them). For writing training text only: the text is labelled by the real target."""

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
        y = torch._int_mm(q, self.weight_t).float() * step * self.scale
        if self.bias is not None:
            y = y + self.bias
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
) -> list[list[int]]:
    """Greedy (or, with a temperature, sampled) continuations of several prompts at once (eos
    left out; `ended`, if given, receives whether each row stopped at eos).

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
            logits = torch.cat(
                [
                    _batched_forward(
                        model,
                        tokens[b : b + 1, start:],
                        cols[start:],
                        offsets[b : b + 1],
                        key_ok[b : b + 1],
                        [(k[b : b + 1], v[b : b + 1]) for k, v in caches],
                    )
                    for b, start in enumerate(offsets.tolist())
                ]
            )
        else:
            logits = _batched_forward(model, tokens, cols, offsets, key_ok, caches)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            chosen = logits.argmax(-1)
        for row, token in zip(rows, chosen.tolist(), strict=True):
            if not done[row]:
                done[row] = token in eos_ids
                if not done[row]:
                    outputs[row].append(token)
        if all(done):
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


def self_written_requests(
    loaded: LoadedModel,
    count: int,
    seed: int,
    path: Path,
    progress: Callable[[str], None],
    writer,
    batch: int = 16,
) -> list[str]:
    """`count` distinct user requests the target writes itself: its chat template up to the
    start of a user message, continued by sampling (temperature 1) until the turn ends
    (Magpie, Xu et al. 2024). Requests cut off by the length limit, very short or repeated
    ones are dropped. Kept in `path` (keyed by model and seed) so reruns reuse them. Written
    by `writer`: an eager model (int8_writer or the target) in batches, or an exported target's
    session one at a time."""
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
    started, barren = time.perf_counter(), 0
    while len(requests) < count:
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
        rate = len(requests) / (time.perf_counter() - started)
        progress(f"the target wrote {len(requests)}/{count} requests ({rate:.1f}/s)")
    return requests[:count]


def generate_with_session(session, prompts: list[list[int]], max_new: int, eos_ids) -> list:
    """Greedy continuations (eos left out), one prompt at a time through an exported target."""
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
    return outputs


def open_target_bundle(path: str, loaded: LoadedModel):
    """The target session of an ExecuTorch bundle of `loaded`, and the hash that names the text
    it writes (the exported file's, so that text from the eager model is not reused)."""
    from mtp_edge.runtime.bundle import open_bundle, target_session

    bundle = open_bundle(path)
    m = bundle.manifest
    if m.model_name != loaded.name or m.vocab_size != loaded.config.vocab_size:
        raise UserError(f"--bundle {path} holds {m.model_name}, not the target {loaded.name}")
    outputs = [o["name"] for o in m.models["target"].methods["forward"]["outputs"]]
    if "hidden" not in outputs:
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
) -> list[Sequence]:
    """Prompt + the target's greedy response, until `gen_tokens` response tokens, written by
    `writer` (an eager model in batches, or an exported target's session one at a time).

    Responses are appended to the cache file as they are made, so an interrupted run (or any
    later run with the same target and seed) continues where it stopped.
    """
    sequences = _responses(
        loaded, options, target_hash, rank, world, progress, writer,
        instruction_prompts(options.seed), options.gen_tokens,
    )  # fmt: skip
    if options.self_prompt_tokens:
        # About one request per 150 response tokens; more are written if they run out.
        count = options.self_prompt_tokens // 150 + 16
        path = artifact_paths(options.out)["requests"]
        requests = self_written_requests(
            loaded, count, options.seed, path, progress, writer, options.gen_batch
        )
        while True:
            try:
                sequences += _responses(
                    loaded, options, target_hash, rank, world, progress, writer,
                    iter(requests), options.self_prompt_tokens,
                )  # fmt: skip
                break
            except StopIteration:
                count = count * 3 // 2
                requests = self_written_requests(
                    loaded, count, options.seed, path, progress, writer, options.gen_batch
                )
    return sequences


def _responses(
    loaded, options, target_hash, rank, world, progress, writer, prompts, budget: int
) -> list[Sequence]:
    path = artifact_paths(options.out)["generated"]
    cached = _read_generated(path, target_hash)
    tokenizer = loaded.tokenizer
    seen: set[str] = set()  # template prompts repeat; a repeat would leak into the held-out set
    sequences: list[Sequence] = []
    total, made, started = 0, 0, time.perf_counter()
    while total < budget:
        batch = []
        while len(batch) < options.gen_batch * world:
            prompt = next(prompts)
            ids = tokenizer.encode_prompt(prompt)
            if prompt not in seen and len(ids) <= options.seq_len:
                seen.add(prompt)
                batch.append((prompt, ids))
        todo = [(p, ids) for p, ids in batch if p not in cached]
        mine = todo[rank::world]
        mine.sort(key=lambda item: len(item[1]))  # similar lengths pad less
        responses = []
        if mine:
            eager = isinstance(writer, Transformer)
            outs = (generate_batch if eager else generate_with_session)(
                writer,
                [ids for _, ids in mine],
                options.gen_max_new,
                tokenizer.eos_ids,
            )
            responses = [
                {
                    "target": target_hash,
                    "prompt": p,
                    "prompt_ids": ids,
                    "response_ids": out,
                    "response": tokenizer.decode(out),
                }
                for (p, ids), out in zip(mine, outs, strict=True)
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
            made += len(entry["response_ids"])
        if not any(cached[p]["response_ids"] for p, _ in batch):
            raise UserError(
                f"{loaded.name} ended every response at once (eos first): it cannot write its own "
                "training text; give text files with --data"
            )
        for prompt, _ in batch:
            entry = cached[prompt]
            if entry["response_ids"] and total < budget:
                sequences.append(
                    Sequence(
                        entry["prompt_ids"] + entry["response_ids"], len(entry["prompt_ids"]) - 1
                    )
                )
                total += len(entry["response_ids"])
        if made:
            rate = made / (time.perf_counter() - started)
            progress(f"generated {total}/{budget} tokens ({rate:.0f} new tokens/s)")
    return sequences


def build_corpus(
    loaded: LoadedModel,
    options: TrainOptions,
    target_hash: str,
    rank: int,
    world: int,
    progress: Callable[[str], None],
    writer=None,
) -> list[Sequence]:
    """The training text. `writer` writes the responses (generated_sequences); by default the
    eager target as --writer says (int8 or fp32)."""
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
        sequences = text_sequences(
            offline_texts(), loaded.tokenizer, options.seq_len, options.raw_tokens, rng
        )
        if writer is None:
            writer = int8_writer(loaded.model) if options.writer == "int8" else loaded.model
        sequences += generated_sequences(
            loaded, options, target_hash, rank, world, progress, writer
        )
    return sequences


# --- 2. labels -------------------------------------------------------------------------------


def _labels(sequences: list[Sequence], hidden, argmax, keys=None, values=None) -> Labels:
    starts, bounds, offset = [], [], 0
    for s in sequences:
        n = len(s.tokens)
        starts.append(torch.arange(offset + s.start, offset + n - 1))  # a next token follows
        bounds.append((offset, n, s.start))
        offset += n
    tokens = torch.tensor([t for s in sequences for t in s.tokens])
    remaining = torch.cat([torch.arange(len(s.tokens) - 1, -1, -1) for s in sequences])
    return Labels(
        hidden if isinstance(hidden, torch.Tensor) else torch.cat(hidden),
        tokens,
        argmax if isinstance(argmax, torch.Tensor) else torch.cat(argmax),
        remaining,
        torch.cat(starts),
        torch.tensor(bounds, dtype=torch.long).view(-1, 3),
        torch.cat(keys) if keys else None,
        torch.cat(values) if values else None,
    )


def _labelling_progress(say, total: int):
    """say() about every tenth of `total` sequences labelled (labelling is minutes of work)."""
    every = max(1, total // 10)

    def done(i: int) -> None:
        if say is not None and ((i + 1) % every == 0 or i + 1 == total):
            say(f"labelled {i + 1}/{total} sequences")

    return done


@torch.inference_mode()
def label_sequences(
    model: Transformer,
    sequences: list[Sequence],
    cache: bool = False,
    dtype: torch.dtype = torch.float16,
    say: Callable[[str], None] | None = None,
) -> Labels:
    """Run the frozen target over each sequence (one teacher-forced call through the static
    cache) and keep, per position, its final hidden state and its argmax (and with `cache`, its
    last layer's K/V as the cache holds them), stored in `dtype`."""
    longest = max(len(s.tokens) for s in sequences)
    if model.max_seq_len < longest:
        model.setup_cache(longest)
    hidden, argmax, keys, values = [], [], [], []
    last = model.layers[-1].self_attn
    done = _labelling_progress(say, len(sequences))
    for i, s in enumerate(sequences):
        n = len(s.tokens)
        logits, h = model(torch.tensor([s.tokens]), torch.tensor([0]), return_hidden=True, kv_len=n)
        hidden.append(h[0].to(dtype))
        argmax.append(logits[0].argmax(-1))
        if cache:  # [1, KVH, S, hd] -> [n, KVH, hd]
            keys.append(last.cache.k[0, :, :n].transpose(0, 1).to(dtype))
            values.append(last.cache.v[0, :, :n].transpose(0, 1).to(dtype))
        done(i)
    return _labels(sequences, hidden, argmax, keys, values)


def label_with_session(session, sequences: list[Sequence], say=None) -> Labels:
    """label_sequences through an exported target: its hidden states and argmax per position.

    The results go straight into tensors allocated once for all positions. Kept as thousands of
    small pieces between the per-call logits (up to 25 MB each, freed at once), they fragmented
    the heap: labelling 723k tokens grew past 18 GB of RSS and was killed."""
    total = sum(len(s.tokens) for s in sequences)
    hidden, argmax, at = None, torch.empty(total, dtype=torch.long), 0
    done = _labelling_progress(say, len(sequences))
    for j, s in enumerate(sequences):
        n = len(s.tokens)
        for i in range(0, n, session.max_chunk):
            logits, h = session.forward(s.tokens[i : i + session.max_chunk], i, True)
            if hidden is None:
                hidden = torch.empty(total, h.shape[-1], dtype=torch.float16)
            rows = len(h)
            hidden[at : at + rows] = h
            argmax[at : at + rows] = logits.argmax(-1)
            at += rows
        done(j)
    return _labels(sequences, hidden, argmax)


def cached_labels(path: Path, sequences, source: str, cache: bool, make, say) -> Labels:
    """Labels of `sequences` from `path` when it holds them for the same text, target and kind,
    else made by `make()` and stored there (labelling is the slow part of a rerun: the eager
    target over every token)."""
    digest = hashlib.sha256(json.dumps([source, cache]).encode())
    for s in sequences:
        digest.update(json.dumps([s.start, s.tokens]).encode())
    key = digest.hexdigest()
    names = ("hidden", "tokens", "argmax", "remaining", "starts", "bounds", "keys", "values")
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") == key:
                say(f"labels read from {path}")
                return Labels(*(f.get_tensor(n) if n in f.keys() else None for n in names))
    except (OSError, SafetensorError):
        pass
    labels = make()
    tensors = {n: getattr(labels, n).contiguous() for n in names if getattr(labels, n) is not None}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key}))
    return labels


# --- 3. draft vocabulary ---------------------------------------------------------------------


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target predictions (ties: lower id) and the share they cover."""
    size = min(size, len(counts))
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = torch.sort(order).values
    coverage = float(counts[ids].sum() / counts.sum().clamp(min=1))
    return ids, coverage


def label_counts(labels: Labels, vocab_size: int) -> torch.Tensor:
    """How often the target predicts each token at the positions draft steps are scored on."""
    return torch.bincount(labels.argmax[labels.starts + 1], minlength=vocab_size)


# --- 4. training-time test -------------------------------------------------------------------


@dataclass
class Batch:
    h: torch.Tensor  # [B, L, D] the target's hidden state at each origin
    embs: torch.Tensor  # [B, L, J, D] embedding of the token step j reads
    reads: torch.Tensor  # [B, L, J] global position whose token step j reads and predicts after
    valid: torch.Tensor  # [B, L, J] a step inside its sequence, from an allowed origin
    context: TrainContext | None


def sequence_batch(labels: Labels, seqs, embedding, k: int, rope, cache: bool) -> Batch:
    """B whole sequences, padded to the longest: every position is a draft origin."""
    bounds = labels.bounds[torch.as_tensor(seqs)]
    offset, n, first = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]
    length = int(n.max())
    t = torch.arange(length)[None]  # local origin
    idx = offset + torch.minimum(t, n - 1)  # [B, L]
    steps = torch.arange(1, k + 1)
    local = t[..., None] + steps  # [B, L, J] position step j reads
    valid = (t >= first)[..., None] & (local <= (n - 1)[..., None])
    reads = offset[..., None] + torch.minimum(local, (n - 1)[..., None])
    context = None
    if cache:  # a head with attention: rotary tables, padding (and the target's K/V if kept)
        cos, sin = rope
        keys = None if labels.keys is None else labels.keys[idx]
        values = None if labels.values is None else labels.values[idx]
        context = TrainContext(keys, values, t < n, cos[: length + k], sin[: length + k])
    h = labels.hidden[idx].to(embedding.dtype)
    return Batch(h, F.embedding(labels.tokens[reads], embedding), reads, valid, context)


def origin_batch(labels: Labels, origins: torch.Tensor, embedding, k: int) -> Batch:
    """Draft origins from anywhere in the text, as one row [1, N]: for heads without attention,
    which read only the hidden state and the tokens, so that no prompt position or padding is
    computed (a sequence batch spends about half its work on those)."""
    steps = torch.arange(1, k + 1)
    left = labels.remaining[origins, None]
    valid = (steps <= left)[None]
    reads = (origins[:, None] + torch.minimum(steps, left))[None]
    h = labels.hidden[origins].to(embedding.dtype)[None]
    return Batch(h, F.embedding(labels.tokens[reads], embedding), reads, valid, None)


def labelled_batches(labels: Labels, embedding, k: int, rope, context: bool, budget: int):
    """Every draft origin of `labels` once, in batches of about `budget` origins."""
    if not context:
        for chunk in labels.starts.split(budget):
            yield origin_batch(labels, chunk, embedding, k)
        return
    for group in batches_of(labels, list(range(len(labels.bounds))), budget):
        yield sequence_batch(labels, group, embedding, k, rope, context)


def draft_losses(logits, batch: Batch, labels: Labels, to_draft, teacher_head, soft: bool):
    """Summed loss [k] and counted steps [k] per draft step. Soft: KL divergence from the
    target's distribution restricted to the draft vocabulary (what the target would say at the
    position step j predicts); hard: against its argmax (steps outside the vocabulary skipped)."""
    if soft:
        with torch.no_grad():
            teacher = F.linear(labels.hidden[batch.reads].to(teacher_head.dtype), teacher_head)
            teacher = torch.softmax(teacher.float(), -1)
        # KL(teacher || head): the cross-entropy less the teacher's own entropy, so 0 is perfect
        ce = teacher * (teacher.clamp_min(1e-30).log() - torch.log_softmax(logits.float(), -1))
        ce = ce.sum(-1)
        keep = batch.valid
    else:
        targets = to_draft[labels.argmax[batch.reads]]
        keep = batch.valid & (targets != IGNORE)
        ce = F.cross_entropy(
            logits.flatten(0, -2).float(),
            targets.masked_fill(~keep, 0).flatten(),
            reduction="none",
        ).view_as(targets)
    ce = ce.masked_fill(~keep, 0.0)
    return ce.flatten(0, 1).sum(0), keep.flatten(0, 1).sum(0)


def feature_losses(hidden, batch: Batch, labels: Labels):
    """Summed hidden-state loss [k] per draft step: smooth L1 between step j's output and the
    target's hidden state at the position whose token step j read (the state the target
    predicts the same next token from), averaged over the hidden dimension."""
    wanted = labels.hidden[batch.reads].to(hidden.dtype)
    loss = F.smooth_l1_loss(hidden.float(), wanted.float(), reduction="none").mean(-1)
    sums = loss.masked_fill(~batch.valid, 0.0).flatten(0, 1).sum(0)
    return sums, batch.valid.flatten(0, 1).sum(0)


def weighted_loss(sums, counts, weights) -> torch.Tensor:
    return (weights * sums / counts.clamp(min=1)).sum() / weights.sum()


def rope_tables(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rope_frequencies(config))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def batches_of(labels: Labels, seqs: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sequences with about `budget` origins each."""
    groups, group, size = [], [], 0
    for i in seqs:
        group.append(i)
        size += int(labels.bounds[i, 1])
        if size >= budget:
            groups.append(group)
            group, size = [], 0
    return groups + ([group] if group else [])


@torch.no_grad()
def evaluate(
    head: MTPHead,
    labels: Labels,
    embedding: torch.Tensor,
    k: int,
    to_draft: torch.Tensor,
    weights: torch.Tensor,
    world: int,
    rope,
    teacher_head: torch.Tensor,
    soft: bool,
    budget: int,
) -> dict:
    """Held-out loss and acceptance per draft position, over every origin of the held-out
    sequences.

    Draft step j from a position counts as accepted when it and every earlier step equal the
    target's argmax. On text the target wrote (greedy), the steps read exactly the tokens
    drafting would feed, so this is the greedy acceptance drafting will see; on other text it is
    a teacher-forced estimate.
    """
    sums, counts, feature, feature_counts, hits, scored = (
        torch.zeros(k, dtype=torch.float64) for _ in range(6)
    )
    for batch in labelled_batches(labels, embedding, k, rope, head.needs_context, budget):
        logits, hidden = head(batch.h, batch.embs, batch.context, return_hidden=True)
        s, c = draft_losses(logits, batch, labels, to_draft, teacher_head, soft)
        f, fc = feature_losses(hidden, batch, labels)
        feature += f
        feature_counts += fc
        sums += s
        counts += c
        right = (head.draft_ids[logits.argmax(-1)] == labels.argmax[batch.reads]) & batch.valid
        first_valid = batch.valid[..., 0]
        hits += (right.long().cumprod(-1).bool() & batch.valid)[first_valid].sum(0)
        scored += batch.valid[first_valid].sum(0)
    if world > 1:
        for t in (sums, counts, feature, feature_counts, hits, scored):
            dist.all_reduce(t)
    acceptance = (hits / scored.clamp(min=1)).tolist()
    return {
        "loss": float(weighted_loss(sums, counts, weights.to(sums.dtype))),
        "feature_loss": round(float(weighted_loss(feature, feature_counts, weights.double())), 4),
        "acceptance": [round(a, 4) for a in acceptance],
        "tau": round(1 + sum(acceptance), 4),
    }


def _describe(result: dict) -> str:
    accepted = "/".join(f"{a:.2f}" for a in result["acceptance"])
    return f"loss {result['loss']:.3f}  acceptance {accepted}  tau~{result['tau']:.2f}"


def learning_rate(step: int, options: TrainOptions) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    done = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done))))


def save_checkpoint(path_st: Path, path_json: Path, head, optimizer, state: dict) -> None:
    """Head and AdamW state as tensors in safetensors, scalars in JSON (no pickle)."""
    tensors = {f"head.{n}": t.detach().contiguous() for n, t in head.state_dict().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"optim.{i}.{key}"] = torch.as_tensor(value).contiguous()
    write_atomically(path_st, lambda tmp: save_file(tensors, str(tmp)))
    write_atomically(path_json, lambda tmp: tmp.write_text(json.dumps(state, indent=2) + "\n"))


def load_checkpoint(path_st: Path, path_json: Path, head, optimizer) -> dict:
    try:
        state = json.loads(path_json.read_text())
        with safe_open(str(path_st), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(
            f"cannot read the checkpoint {path_st}: {e}; rerun without --resume"
        ) from None
    head.load_state_dict({n[5:]: t for n, t in tensors.items() if n.startswith("head.")})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, i, key = name.split(".", 2)
            optimizer.state[params[int(i)]][key] = tensor
    return state


def _distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether we started the process group) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    return dist.get_rank(), world, started


def _split(n: int, fraction: float, seed: int, world: int) -> tuple[list[int], list[int]]:
    """Sequence indices for training and held-out evaluation, at least one per rank each."""
    cut = max(world, round(n * fraction))
    if n - cut < world:
        raise UserError(
            f"the training text makes only {n} sequences, too few to train and hold out some "
            f"on {world} process(es): give more text"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[cut:]), sorted(order[:cut])


def _without_steps(recipe: dict) -> dict:
    """A resumed run may change --steps (train longer); everything else must match."""
    return {k: v for k, v in recipe.items() if k != "steps"}


def train_heads(options: TrainOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Train MTP heads for options.model and write options.out (+ .json); returns a summary."""
    began = time.perf_counter()
    rank, world, started = _distributed()
    try:
        return _train(options, rank, world, progress or print, began)
    finally:
        if started:
            dist.destroy_process_group()


def _train(options, rank, world, progress, began) -> dict:
    def say(message: str) -> None:
        if rank == 0:
            progress(message)

    if options.threads:
        torch.set_num_threads(options.threads)
    paths = artifact_paths(options.out)
    if rank == 0:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    loaded = load_model(options.model)
    target = loaded.model.requires_grad_(False)
    target_hash = target_fingerprint(target)
    c = target.config
    start = None
    if options.init:  # continue training these heads: their design carries over
        start = load_heads(options.init, target, loaded.name)
        options.attention = start.config.attention
        say(f"starting from {options.init} ({start.config.attention} attention)")
    session, bundle_hash = None, None
    if options.bundle:
        session, bundle_hash = open_target_bundle(options.bundle, loaded)
    # The cache of written text is keyed by who wrote it.
    text_hash, writer = {
        "bundle": (bundle_hash, session),
        "fp32": (target_hash, target),
        "int8": ("int8-" + target_hash, None),
    }[options.writer]
    say(
        f"{'the exported target' if options.writer == 'bundle' else options.writer + ' target'}"
        f" writes the text; {'the exported target' if session else 'the target'} labels it"
    )

    sequences = build_corpus(loaded, options, text_hash, rank, world, say, writer)
    if options.write_only:
        tokens = sum(len(s.tokens) - s.start for s in sequences)
        say(f"wrote the text: {len(sequences)} sequences, {tokens} tokens to draft from")
        return {"sequences": len(sequences), "draft_tokens": tokens}
    train_ids, heldout_ids = _split(len(sequences), options.heldout, options.seed, world)
    say(f"labelling {sum(len(s.tokens) for s in sequences)} tokens in {len(sequences)} sequences")

    cache = options.attention == "target_cache"  # labels keep the target's last-layer K/V
    context = options.attention != "none"

    def label(ids: list[int], part: str) -> Labels:
        chosen = [sequences[i] for i in ids[rank::world]]
        # The exported program returns no K/V: heads that read the cache learn it from the
        # eager target (the bundle still writes the text).
        by_session = session is not None and not cache
        source = bundle_hash if by_session else target_hash
        path = paths["labels"].with_name(f"{paths['labels'].name}.{part}{rank}.safetensors")
        return cached_labels(
            path,
            chosen,
            source,
            cache,
            lambda: (
                label_with_session(session, chosen, say)
                if by_session
                else label_sequences(target, chosen, cache, say=say)
            ),
            say,
        )

    train, heldout = label(train_ids, "train"), label(heldout_ids, "heldout")

    counts = label_counts(train, c.vocab_size)
    heldout_counts = label_counts(heldout, c.vocab_size)
    if world > 1:
        dist.all_reduce(counts)
        dist.all_reduce(heldout_counts)
    # Heads trained further (--init) take the vocabulary of the text they now learn, at their
    # own size: text of another kind uses other tokens (v6's 8192, chosen on template answers,
    # covered 93.6% of the target's choices on answers to self-written requests).
    size = options.draft_vocab if start is None else start.config.draft_vocab_size
    draft_ids, coverage = draft_vocabulary(counts, size)
    to_draft = torch.full((c.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    say(
        f"draft vocabulary {len(draft_ids)} tokens: covers {coverage:.1%} of the target's "
        f"predictions in training, "
        f"{float(heldout_counts[draft_ids].sum() / heldout_counts.sum().clamp(min=1)):.1%} held out"
    )

    torch.manual_seed(options.seed)
    config = MTPConfig(
        hidden_size=c.hidden_size,
        intermediate_size=options.intermediate_size or c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=len(draft_ids),
        rms_norm_eps=c.rms_norm_eps,
        num_blocks=options.num_blocks,
        target_name=loaded.name,
        target_hash=target_hash,
        k=options.k,
        **(cache_attention_config(target, options.attention) if context else {}),
    )
    if start is not None:
        config = MTPConfig.from_dict({**start.config.to_dict(), "k": options.k, "recipe": {}})
        head = MTPHead(config)
        head.load_state_dict(start.float().state_dict())
        carry_vocabulary(head, start, target, draft_ids)
    else:
        head = init_from_target(MTPHead(config), target, draft_ids)
    head.lm_head.weight.requires_grad_(options.train_lm_head)
    model = head
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(head)
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad],
        lr=options.lr,
        betas=(0.9, 0.95),
        weight_decay=options.weight_decay,
    )
    weights = options.step_decay ** torch.arange(options.k, dtype=torch.float32)
    embedding = target.embed_tokens.weight.detach()
    teacher_head = target_lm_head(target).detach()[draft_ids]
    soft = options.labels == "soft"
    longest = int(max(train.bounds[:, 1].max(), heldout.bounds[:, 1].max()))
    rope = rope_tables(c, longest + options.k + 1)

    step, history = 0, []
    recipe = options.recipe()
    if options.resume and paths["checkpoint"].is_file():
        state = load_checkpoint(paths["checkpoint"], paths["checkpoint_json"], head, optimizer)
        if (
            _without_steps(state["recipe"]) != _without_steps(recipe)
            or state["world_size"] != world
        ):
            raise UserError(
                f"{paths['checkpoint']} was made with other options or another number of "
                "processes: rerun with the same ones, or without --resume"
            )
        if not torch.equal(head.draft_ids, draft_ids):
            raise UserError(
                f"the training text changed since {paths['checkpoint']}: rerun without --resume"
            )
        step, history = state["step"], state["history"]
        say(f"resumed at step {step}")
    elif options.resume:
        say(f"no checkpoint at {paths['checkpoint']}: starting from scratch")

    def held_out() -> dict:
        return evaluate(
            head,
            heldout,
            embedding,
            options.k,
            to_draft,
            weights,
            world,
            rope,
            teacher_head,
            soft,
            options.batch_size,
        )

    def training_batch(generator) -> Batch:
        """--batch-size draft origins drawn at random from the whole text; for heads with
        attention, random whole sequences holding about that many (they need the context)."""
        if not context:
            draw = torch.randint(len(train.starts), (options.batch_size,), generator=generator)
            return origin_batch(train, train.starts[draw], embedding, options.k)
        order = torch.randperm(len(train.bounds), generator=generator).tolist()
        group = batches_of(train, order, options.batch_size)[0]
        return sequence_batch(train, group, embedding, options.k, rope, context)

    if step == 0:
        history.append({"step": 0, **held_out()})
        say("step 0  held-out " + _describe(history[-1]))
    running, last_log = [], time.perf_counter()
    while step < options.steps:
        # Batches depend only on (seed, rank, step), so a resumed run draws the same ones.
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + rank * 7919 + step)
        batch = training_batch(generator)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        logits, hidden = model(batch.h, batch.embs, batch.context, return_hidden=True)
        sums, counts = draft_losses(logits, batch, train, to_draft, teacher_head, soft)
        loss = weighted_loss(sums, counts, weights)
        if options.feature_loss:
            loss = loss + options.feature_loss * weighted_loss(
                *feature_losses(hidden, batch, train), weights
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        running.append(float(loss.detach()))
        step += 1

        if step % options.eval_every == 0 or step == options.steps:
            history.append({"step": step, "train_loss": sum(running) / len(running), **held_out()})
        if rank == 0 and (step % options.checkpoint_every == 0 or step == options.steps):
            state = {"step": step, "recipe": recipe, "world_size": world, "history": history}
            save_checkpoint(paths["checkpoint"], paths["checkpoint_json"], head, optimizer, state)
        if step % options.log_every == 0 or step == options.steps:
            rate = len(running) / (time.perf_counter() - last_log)
            line = f"step {step}/{options.steps}  loss {sum(running) / len(running):.3f}"
            line += f"  held-out {_describe(history[-1])} (step {history[-1]['step']})"
            say(f"{line}  lr {learning_rate(step - 1, options):.1e}  {rate:.1f} steps/s")
            running, last_log = [], time.perf_counter()

    final = history[-1]
    summary = {
        "out": str(options.out),
        "target": loaded.name,
        "steps": step,
        "world_size": world,
        "train_tokens": int(train.bounds[:, 1].sum()),
        "sequences": len(sequences),
        "draft_vocab": len(draft_ids),
        "coverage": round(coverage, 4),
        "heldout_loss": round(final["loss"], 4),
        "heldout_acceptance": final["acceptance"],
        "heldout_tau": final["tau"],
        "seconds": round(time.perf_counter() - began, 1),
    }
    config.recipe = {**recipe, **{k: v for k, v in summary.items() if k != "out"}}
    summary["history"] = history
    if rank == 0:
        save_heads(head, config, options.out)
        say(f"wrote {options.out}: held-out {_describe(final)}, {summary['seconds']:.0f} s")
    return summary
