// The regular expressions of tokenizer.json pre-tokenizers (Split, ByteLevel), matched the way
// the `tokenizers` library's Oniguruma matches them: leftmost match, alternatives tried in order,
// greedy quantifiers that backtrack. Only the syntax those patterns use is accepted:
// alternation, (?:...), (?i:...), (?=...), (?!...), classes with ranges and \p{..}/\P{..},
// \s \S \d \D, escapes, and the quantifiers ? * + {n} {n,} {n,m} (optionally lazy).
// Anything else is refused when the pattern is compiled, so a tokenizer never silently splits
// differently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mtp {

class SplitRegex {
 public:
  // Throws std::runtime_error naming the unsupported construct.
  explicit SplitRegex(const std::string& pattern);
  ~SplitRegex();
  SplitRegex(SplitRegex&&) noexcept;
  SplitRegex& operator=(SplitRegex&&) noexcept;

  // [start, end) of each successive non-empty match in text, in code point indices.
  std::vector<std::pair<size_t, size_t>> find_all(const std::u32string& text) const;

  struct Node;

 private:
  std::unique_ptr<Node> root_;
};

}  // namespace mtp
