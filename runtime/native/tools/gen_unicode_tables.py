"""Write src/unicode_tables.h: the Unicode facts the C++ tokenizer needs, from Python's unicodedata.

The split regexes of tokenizer.json use \\p{L}, \\p{N}, \\s and (?i:...); the qwen2 family
normalizes to NFC. Generating the tables here keeps the native build free of ICU and PCRE.
Run: python runtime/native/tools/gen_unicode_tables.py (rewrites the header in place).

Token identity with `tokenizers` is the requirement, and its Unicode is not Python's, so two
exceptions are measured on `tokenizers` itself:
- Code points Python does not know yet (Python 3.11: Unicode 14) but `tokenizers`' regex
  engine (Oniguruma) and Rust (Digits) do, take the general category its \\p{..} gives them.
- NFC: `tokenizers` normalizes with older tables (unicode-normalization-alignments, Unicode 9
  era), so marks added since then do not reorder there and pairs encoded since then do not
  compose; the NFC tables keep only what its own NFC is seen to do.
"""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path

import tokenizers.normalizers
from tokenizers import Regex, pre_tokenizers

OUT = Path(__file__).resolve().parent.parent / "src" / "unicode_tables.h"
MAX_CP = 0x110000
# The order of mtp::unicode::Category in unicode.h.
CATEGORIES = (
    "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Ps Pe Pi Pf Po Sm Sc Sk So Zs Zl Zp Cc Cf Cs Co Cn"
).split()


def matching(pattern: str, code_points: list[int]) -> list[int]:
    """The code points `tokenizers`' own regex engine matches with `pattern` (one character)."""
    split = pre_tokenizers.Split(Regex(pattern), behavior="removed")
    kept = set(
        "".join(piece for piece, _ in split.pre_tokenize_str("".join(map(chr, code_points))))
    )
    return [cp for cp in code_points if chr(cp) not in kept]


def newer_categories() -> dict[int, int]:
    """Categories `tokenizers` gives code points that Python's unicodedata calls unassigned."""
    unknown = [
        cp
        for cp in range(MAX_CP)
        if unicodedata.category(chr(cp)) == "Cn" and not 0xD800 <= cp < 0xE000
    ]
    assigned = matching(r"\P{Cn}", unknown)
    found = {}
    for index, name in enumerate(CATEGORIES):
        for cp in matching(rf"\p{{{name}}}", assigned):
            found[cp] = index
    missing = set(assigned) - set(found)
    assert not missing, f"no general category found for {sorted(missing)[:5]}"
    return found


def category_ranges(newer: dict[int, int]) -> list[tuple[int, int]]:
    """(first code point, category) at every change of general category."""
    ranges, previous = [], None
    for cp in range(MAX_CP):
        cat = newer.get(cp, CATEGORIES.index(unicodedata.category(chr(cp))))
        if cat != previous:
            ranges.append((cp, cat))
            previous = cat
    return ranges


def white_space() -> list[int]:
    """The White_Space property (Oniguruma's \\s): str.isspace() also counts U+001C..U+001F."""
    return [cp for cp in range(MAX_CP) if chr(cp).isspace() and not 0x1C <= cp <= 0x1F]


def reorders_in_reference(cp: int, nfc) -> bool:
    """Whether `tokenizers`' NFC knows this mark's class: it moves a lower-class mark ahead."""
    c = chr(cp)
    probe = "\u0915" + (c + "\u0334" if unicodedata.combining(c) > 1 else "\u0301" + c)
    return nfc(probe) != probe


def combining_classes(nfc) -> list[tuple[int, int, int]]:
    ranges = []
    for cp in range(MAX_CP):
        ccc = unicodedata.combining(chr(cp))
        if ccc and not reorders_in_reference(cp, nfc):
            continue
        if ccc and ranges and ranges[-1][1] == cp - 1 and ranges[-1][2] == ccc:
            ranges[-1] = (ranges[-1][0], cp, ccc)
        elif ccc:
            ranges.append((cp, cp, ccc))
    return ranges


def canonical_decompositions(nfd) -> list[tuple[int, int, int]]:
    """One level of canonical decomposition (second part 0 for singletons); Hangul is computed.
    Characters `tokenizers` leaves whole (encoded after its tables) stay whole."""
    table = []
    for cp in range(MAX_CP):
        mapping = unicodedata.decomposition(chr(cp))
        if not mapping or mapping.startswith("<") or nfd(chr(cp)) == chr(cp):
            continue
        parts = [int(p, 16) for p in mapping.split()]
        table.append((cp, parts[0], parts[1] if len(parts) > 1 else 0))
    return table


def compositions(decompositions, nfc) -> list[tuple[int, int, int]]:
    """Primary composites: pairs that NFC recombines (composition exclusions drop out)."""
    pairs = [
        (a, b, cp)
        for cp, a, b in decompositions
        if b
        and unicodedata.normalize("NFC", chr(a) + chr(b)) == chr(cp)
        and nfc(chr(a) + chr(b)) == chr(cp)
    ]
    return sorted(pairs)


def simple_case_folds() -> list[tuple[int, int]]:
    """Code points whose case fold is one other code point, for (?i:...) in split regexes."""
    folds = []
    for cp in range(MAX_CP):
        c = chr(cp)
        folded = c.casefold()
        if len(folded) != 1:
            folded = c.lower()
        if len(folded) == 1 and folded != c:
            folds.append((cp, ord(folded)))
    return folds


def rows(items, per_line: int) -> str:
    lines = []
    for i in range(0, len(items), per_line):
        lines.append("    " + " ".join(items[i : i + per_line]))
    return "\n".join(lines)


def main() -> None:
    nfc = tokenizers.normalizers.NFC().normalize_str
    decompositions = canonical_decompositions(tokenizers.normalizers.NFD().normalize_str)
    parts = [
        "// Generated by runtime/native/tools/gen_unicode_tables.py from Python "
        f"{sys.version_info.major}.{sys.version_info.minor}'s unicodedata "
        f"(Unicode {unicodedata.unidata_version}); newer code points and NFC as `tokenizers` "
        f"{tokenizers.__version__} treats them. Do not edit.",
        "#pragma once",
        "#include <cstdint>",
        "",
        "namespace mtp::unicode::tables {",
        "",
        f'inline constexpr const char* kUnicodeVersion = "{unicodedata.unidata_version}";',
        "",
        "// General category from each start up to the next start: {first code point, category}.",
        "struct CategoryRange { uint32_t first; uint8_t category; };",
        "inline constexpr CategoryRange kCategories[] = {",
        rows([f"{{0x{a:X},{c}}}," for a, c in category_ranges(newer_categories())], 8),
        "};",
        "",
        "inline constexpr uint32_t kWhiteSpace[] = {",
        rows([f"0x{c:X}," for c in white_space()], 10),
        "};",
        "",
        "struct CombiningRange { uint32_t first, last; uint8_t ccc; };",
        "inline constexpr CombiningRange kCombiningClasses[] = {",
        rows([f"{{0x{a:X},0x{b:X},{c}}}," for a, b, c in combining_classes(nfc)], 6),
        "};",
        "",
        "// Canonical decomposition, one level, sorted by code point; second == 0: singleton.",
        "struct Decomposition { uint32_t cp, first, second; };",
        "inline constexpr Decomposition kDecompositions[] = {",
        rows([f"{{0x{a:X},0x{b:X},0x{c:X}}}," for a, b, c in decompositions], 5),
        "};",
        "",
        "// Primary composites sorted by (first, second).",
        "struct Composition { uint32_t first, second, cp; };",
        "inline constexpr Composition kCompositions[] = {",
        rows([f"{{0x{a:X},0x{b:X},0x{c:X}}}," for a, b, c in compositions(decompositions, nfc)], 5),
        "};",
        "",
        "// Simple case folding, sorted by code point.",
        "struct CaseFold { uint32_t cp, folded; };",
        "inline constexpr CaseFold kCaseFolds[] = {",
        rows([f"{{0x{a:X},0x{b:X}}}," for a, b in simple_case_folds()], 7),
        "};",
        "",
        "}  // namespace mtp::unicode::tables",
        "",
    ]
    OUT.write_text("\n".join(parts))
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
