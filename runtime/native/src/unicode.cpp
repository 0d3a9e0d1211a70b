#include "unicode.h"

#include <algorithm>
#include <array>
#include <unordered_map>

#include "unicode_tables.h"

namespace mtp::unicode {
namespace t = tables;

namespace {

// Hangul syllables compose and decompose by arithmetic (Unicode 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr int kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount;
constexpr int kSCount = kLCount * kNCount;

std::array<Category, 128> ascii_categories() {
  std::array<Category, 128> table{};
  size_t r = 0;
  for (char32_t c = 0; c < 128; ++c) {
    while (r + 1 < std::size(t::kCategories) && t::kCategories[r + 1].first <= c) ++r;
    table[c] = static_cast<Category>(t::kCategories[r].category);
  }
  return table;
}

uint8_t combining_class(char32_t c) {
  if (c < 0x300) return 0;
  const auto* end = std::end(t::kCombiningClasses);
  const auto* it = std::upper_bound(std::begin(t::kCombiningClasses), end, c,
                                    [](char32_t v, const t::CombiningRange& r) { return v < r.first; });
  if (it == std::begin(t::kCombiningClasses)) return 0;
  --it;
  return c <= it->last ? it->ccc : 0;
}

void decompose(char32_t c, std::u32string& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const int s = static_cast<int>(c - kSBase);
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* end = std::end(t::kDecompositions);
  const auto* it = std::lower_bound(std::begin(t::kDecompositions), end, c,
                                    [](const t::Decomposition& d, char32_t v) { return d.cp < v; });
  if (it == end || it->cp != c) {
    out.push_back(c);
    return;
  }
  decompose(it->first, out);
  if (it->second) decompose(it->second, out);
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* end = std::end(t::kCompositions);
  const auto* it = std::lower_bound(
      std::begin(t::kCompositions), end, std::make_pair(a, b),
      [](const t::Composition& c, const std::pair<char32_t, char32_t>& v) {
        return c.first < v.first || (c.first == v.first && c.second < v.second);
      });
  return it != end && it->first == a && it->second == b ? it->cp : 0;
}

}  // namespace

const char* unicode_version() { return t::kUnicodeVersion; }

Category category(char32_t c) {
  static const std::array<Category, 128> ascii = ascii_categories();
  if (c < 128) return ascii[c];
  if (c > 0x10FFFF) return Cn;
  const auto* it = std::upper_bound(std::begin(t::kCategories), std::end(t::kCategories), c,
                                    [](char32_t v, const t::CategoryRange& r) { return v < r.first; });
  return static_cast<Category>((it - 1)->category);
}

bool is_white_space(char32_t c) {
  if (c < 128) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return std::binary_search(std::begin(t::kWhiteSpace), std::end(t::kWhiteSpace), c);
}

bool is_numeric(char32_t c) {
  const Category cat = category(c);
  return cat == Nd || cat == Nl || cat == No;
}

char32_t simple_fold(char32_t c) {
  const auto* end = std::end(t::kCaseFolds);
  const auto* it = std::lower_bound(std::begin(t::kCaseFolds), end, c,
                                    [](const t::CaseFold& f, char32_t v) { return f.cp < v; });
  return it != end && it->cp == c ? it->folded : c;
}

const std::vector<char32_t>& fold_equivalents(char32_t c) {
  static const auto* classes = [] {
    auto* by_fold = new std::unordered_map<char32_t, std::vector<char32_t>>();
    for (const auto& f : t::kCaseFolds) {
      auto& members = (*by_fold)[f.folded];
      if (members.empty()) members.push_back(f.folded);
      members.push_back(f.cp);
    }
    return by_fold;
  }();
  static const std::vector<char32_t> none;
  auto it = classes->find(simple_fold(c));
  return it == classes->end() ? none : it->second;
}

std::u32string nfc(const std::u32string& text) {
  if (std::all_of(text.begin(), text.end(), [](char32_t c) { return c < 0x300; })) return text;
  std::u32string s;
  s.reserve(text.size());
  for (char32_t c : text) decompose(c, s);
  // Canonical order: a stable sort of each run of non-starters by combining class.
  for (size_t i = 1; i < s.size(); ++i) {
    const uint8_t cc = combining_class(s[i]);
    if (cc == 0) continue;
    for (size_t j = i; j > 0; --j) {
      const uint8_t prev = combining_class(s[j - 1]);
      if (prev == 0 || prev <= cc) break;
      std::swap(s[j - 1], s[j]);
    }
  }
  if (s.empty()) return s;
  // Canonical composition (the algorithm of UAX #15's sample code).
  size_t starter = 0, out = 1;
  int last_class = combining_class(s[0]) ? 256 : 0;
  for (size_t i = 1; i < s.size(); ++i) {
    const char32_t c = s[i];
    const int cc = combining_class(c);
    const char32_t composite = compose(s[starter], c);
    if (composite && (last_class < cc || last_class == 0)) {
      s[starter] = composite;
      continue;
    }
    if (cc == 0) starter = out;
    last_class = cc;
    s[out++] = c;
  }
  s.resize(out);
  return s;
}

namespace {

// Length of the sequence starting with lead byte b and the valid range of its second byte;
// 0 for a byte that cannot start one.
int sequence_length(unsigned char b, unsigned char& lo, unsigned char& hi) {
  lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b == 0xE0) lo = 0xA0;
  if (b == 0xED) hi = 0x9F;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b == 0xF0) lo = 0x90;
  if (b == 0xF4) hi = 0x8F;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

// Decode one code point at i; on malformed input return false with `used` = the maximal
// invalid subpart's length.
bool next_code_point(const std::string& s, size_t i, char32_t& c, size_t& used) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) {
    c = b, used = 1;
    return true;
  }
  unsigned char lo, hi;
  const int n = sequence_length(b, lo, hi);
  used = 1;
  if (n == 0) return false;
  c = b & (0xFF >> (n + 1));
  for (int k = 1; k < n; ++k) {
    if (i + k >= s.size()) return false;
    const auto x = static_cast<unsigned char>(s[i + k]);
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) return false;
    c = (c << 6) | (x & 0x3F);
    used = k + 1;
  }
  return true;
}

}  // namespace

bool decode_utf8(const std::string& text, std::u32string& out) {
  out.clear();
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    char32_t c;
    size_t used;
    if (!next_code_point(text, i, c, used)) return false;
    out.push_back(c);
    i += used;
  }
  return true;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string to_utf8(const std::u32string& text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) append_utf8(out, c);
  return out;
}

std::string utf8_lossy(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    char32_t c;
    size_t used;
    if (next_code_point(bytes, i, c, used)) {
      out.append(bytes, i, used);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += used;
  }
  return out;
}

}  // namespace mtp::unicode
