// Unicode facts for the tokenizer: UTF-8, general categories, White_Space, case folding, NFC.
// Tables come from src/unicode_tables.h (generated from Python's unicodedata), so the native
// build needs neither ICU nor PCRE.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mtp::unicode {

// The order of tools/gen_unicode_tables.py CATEGORIES.
enum Category : uint8_t {
  Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps, Pe, Pi, Pf, Po,
  Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co, Cn, kCategoryCount
};

const char* unicode_version();
Category category(char32_t c);
bool is_white_space(char32_t c);  // the White_Space property, Oniguruma's \s
bool is_numeric(char32_t c);      // Nd, Nl or No, Rust's char::is_numeric
char32_t simple_fold(char32_t c);
// Code points other than c that fold to the same code point as c (for case-insensitive sets).
const std::vector<char32_t>& fold_equivalents(char32_t c);

std::u32string nfc(const std::u32string& text);

// Strict UTF-8 to code points; false on malformed input.
bool decode_utf8(const std::string& text, std::u32string& out);
void append_utf8(std::string& out, char32_t c);
std::string to_utf8(const std::u32string& text);
// Malformed sequences become U+FFFD, one per maximal invalid subpart (as Rust's
// String::from_utf8_lossy and Python's errors="replace" do).
std::string utf8_lossy(const std::string& bytes);

}  // namespace mtp::unicode
