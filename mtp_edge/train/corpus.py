"""The text to draft on: the user's files, offline text, and instruction prompts built from it."""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from mtp_edge.errors import UserError


@dataclass
class Sequence:
    tokens: list[int]
    start: int  # first position a draft may start from (the last prompt token of a chat turn)
    kind: str = ""  # the kind of text, for per-category results ("": the user's, unknown)
    # The request an answer belongs to (--prompts): the held-out split keeps its answers together
    group: str = ""


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

    from mtp_edge.texts import HELDOUT_TOPICS

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
    texts: list[str],
    tokenizer,
    seq_len: int,
    budget: int | None,
    rng: random.Random,
    kind: str = "",
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
            sequences.append(Sequence(ids, 0, kind))
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
    return (prompt for _, prompt in kinded_prompts(seed))


def kinded_prompts(seed: int) -> Iterator[tuple[str, str]]:
    """instruction_prompts with the kind of each (its template's group: "code", "math", ...)."""
    m = _material()
    rng = random.Random(seed)
    kinds = sorted(_TEMPLATES)
    while True:
        kind = rng.choice(kinds)
        template = rng.choice(_TEMPLATES[kind])
        (func, doc), (func2, _) = rng.choice(m.functions), rng.choice(m.functions)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        yield (
            kind,
            template.format(
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
            ),
        )
