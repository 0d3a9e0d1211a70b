#include "tokenizer.h"

#include <algorithm>
#include <fstream>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "split_regex.h"
#include "unicode.h"

namespace mtp {
namespace {

using json = nlohmann::json;
using unicode::to_utf8;

// The GPT-2 pattern the ByteLevel pre-tokenizer splits with when use_regex is set.
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

[[noreturn]] void unsupported(const std::string& what) {
  throw std::runtime_error("unsupported tokenizer.json: " + what);
}

std::u32string to_u32(const std::string& text) {
  std::u32string out;
  if (!unicode::decode_utf8(text, out)) unsupported("a string that is not valid UTF-8");
  return out;
}

// GPT-2's byte-to-character alphabet: printable latin-1 bytes stand for themselves, the others
// are shifted to U+0100 and up, so that every byte is a visible character.
struct ByteAlphabet {
  char32_t byte_char[256];
  std::unordered_map<char32_t, uint8_t> char_byte;
  ByteAlphabet() {
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + shifted++);
      char_byte[byte_char[b]] = static_cast<uint8_t>(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

void replace_all(std::u32string& s, const std::u32string& from, const std::u32string& to) {
  if (from.empty()) return;
  std::u32string out;
  size_t i = 0;
  for (size_t hit; (hit = s.find(from, i)) != std::u32string::npos; i = hit + from.size())
    out.append(s, i, hit - i).append(to);
  out.append(s, i, std::u32string::npos);
  s.swap(out);
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t i = 0;
  for (size_t hit; (hit = s.find(from, i)) != std::string::npos; i = hit + from.size())
    out.append(s, i, hit - i).append(to);
  out.append(s, i, std::string::npos);
  s.swap(out);
}

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Behavior parse_behavior(const std::string& name) {
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  unsupported("split behavior " + name);
}

struct Span {
  size_t start, end;
  bool is_match;
};

// A piece of text on its way through the pre-tokenizers; at_start: it begins at the start of
// the input (Metaspace's "first" prepend scheme asks).
struct Piece {
  std::u32string text;
  bool at_start;
};

// Pieces of `in` from its matches, as `tokenizers` NormalizedString::split builds them.
void split_pieces(const Piece& in, std::vector<Span> spans, Behavior behavior,
                  std::vector<Piece>& out) {
  std::vector<Span> kept;  // is_match here means "drop"
  switch (behavior) {
    case Behavior::kRemoved:
      kept = std::move(spans);
      break;
    case Behavior::kIsolated:
      for (auto& s : spans) kept.push_back({s.start, s.end, false});
      break;
    case Behavior::kContiguous: {
      bool previous = false;
      for (auto& s : spans) {
        if (s.is_match == previous && !kept.empty()) kept.back().end = s.end;
        else kept.push_back({s.start, s.end, false});
        previous = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous = false;
      for (auto& s : spans) {
        if (s.is_match && !previous && !kept.empty()) kept.back().end = s.end;
        else kept.push_back({s.start, s.end, false});
        previous = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous && !kept.empty()) kept.back().start = it->start;
        else kept.push_back({it->start, it->end, false});
        previous = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  for (const auto& s : kept)
    if (!s.is_match && s.end > s.start)
      out.push_back({in.text.substr(s.start, s.end - s.start), in.at_start && s.start == 0});
}

// Matches and the gaps between them, in order, covering the whole text.
std::vector<Span> with_gaps(const std::vector<std::pair<size_t, size_t>>& matches, size_t size,
                            bool invert) {
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [start, end] : matches) {
    if (prev != start) spans.push_back({prev, start, invert});
    spans.push_back({start, end, !invert});
    prev = end;
  }
  if (prev != size) spans.push_back({prev, size, invert});
  return spans;
}

struct Normalizer {
  enum Kind { kNFC, kReplace, kPrepend } kind;
  std::u32string a, b;

  void apply(std::u32string& s) const {
    switch (kind) {
      case kNFC: s = unicode::nfc(s); break;
      case kReplace: replace_all(s, a, b); break;
      case kPrepend:
        if (!s.empty()) s.insert(0, a);
        break;
    }
  }
};

enum class PrependScheme { kAlways, kFirst, kNever };

PrependScheme parse_prepend_scheme(const std::string& name) {
  if (name == "always") return PrependScheme::kAlways;
  if (name == "first") return PrependScheme::kFirst;
  if (name == "never") return PrependScheme::kNever;
  unsupported("Metaspace prepend_scheme " + name);
}

struct PreTokenizer {
  enum Kind { kDigits, kByteLevel, kSplit, kMetaspace } kind;
  bool individual_digits = false;
  bool add_prefix_space = false;
  bool use_regex = true;
  std::shared_ptr<SplitRegex> regex;  // ByteLevel with use_regex, or Split with a Regex
  std::u32string literal;             // Split with a String pattern
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  char32_t replacement = U'\u2581';  // Metaspace
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;

  std::vector<std::pair<size_t, size_t>> literal_matches(const std::u32string& text) const {
    std::vector<std::pair<size_t, size_t>> matches;
    if (literal.empty()) return matches;
    for (size_t i = 0; (i = text.find(literal, i)) != std::u32string::npos; i += literal.size())
      matches.emplace_back(i, i + literal.size());
    return matches;
  }

  static std::vector<std::pair<size_t, size_t>> char_matches(const std::u32string& text,
                                                             bool (*is_match)(char32_t, char32_t),
                                                             char32_t arg) {
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t i = 0; i < text.size(); ++i)
      if (is_match(text[i], arg)) matches.emplace_back(i, i + 1);
    return matches;
  }

  void apply(const std::vector<Piece>& in, std::vector<Piece>& out) const {
    for (const auto& piece : in) {
      const std::u32string& text = piece.text;
      switch (kind) {
        case kDigits: {
          auto numeric = [](char32_t c, char32_t) { return unicode::is_numeric(c); };
          split_pieces(piece, with_gaps(char_matches(text, numeric, 0), text.size(), false),
                       individual_digits ? Behavior::kIsolated : Behavior::kContiguous, out);
          break;
        }
        case kSplit: {
          auto matches = regex ? regex->find_all(text) : literal_matches(text);
          split_pieces(piece, with_gaps(matches, text.size(), invert), behavior, out);
          break;
        }
        case kByteLevel: {
          Piece prefixed = piece;
          if (add_prefix_space && (text.empty() || text[0] != U' '))
            prefixed.text.insert(0, 1, U' ');
          std::vector<Piece> parts;
          if (use_regex) {
            const auto matches = regex->find_all(prefixed.text);
            split_pieces(prefixed, with_gaps(matches, prefixed.text.size(), false),
                         Behavior::kIsolated, parts);
          } else if (!prefixed.text.empty()) {
            parts.push_back(prefixed);
          }
          const auto& alphabet = byte_alphabet();
          for (const auto& part : parts) {
            Piece mapped{{}, part.at_start};
            for (unsigned char b : to_utf8(part.text)) mapped.text.push_back(alphabet.byte_char[b]);
            out.push_back(std::move(mapped));
          }
          break;
        }
        case kMetaspace: {
          Piece replaced = piece;
          for (char32_t& c : replaced.text)
            if (c == U' ') c = replacement;
          const bool starts = !replaced.text.empty() && replaced.text[0] == replacement;
          if (!starts && (prepend_scheme == PrependScheme::kAlways ||
                          (prepend_scheme == PrependScheme::kFirst && piece.at_start)))
            replaced.text.insert(0, 1, replacement);
          if (!split) {
            if (!replaced.text.empty()) out.push_back(std::move(replaced));
            break;
          }
          auto same = [](char32_t c, char32_t r) { return c == r; };
          const auto matches = char_matches(replaced.text, same, replacement);
          split_pieces(replaced, with_gaps(matches, replaced.text.size(), false),
                       Behavior::kMergedWithNext, out);
          break;
        }
      }
    }
  }
};

struct Decoder {
  enum Kind { kByteLevel, kByteFallback, kFuse, kStrip, kReplace, kMetaspace } kind;
  std::string pattern, content;  // Replace
  char32_t strip_char = 0;       // Strip; Metaspace: the replacement character
  size_t start = 0, stop = 0;    // Strip
  PrependScheme prepend_scheme = PrependScheme::kAlways;  // Metaspace

  void apply(std::vector<std::string>& tokens) const {
    switch (kind) {
      case kByteLevel: {
        const auto& alphabet = byte_alphabet();
        std::string bytes;
        for (const auto& token : tokens) {
          std::u32string chars;
          unicode::decode_utf8(token, chars);
          std::string mapped;
          bool all_mapped = true;
          for (char32_t c : chars) {
            auto it = alphabet.char_byte.find(c);
            if (it == alphabet.char_byte.end()) {
              all_mapped = false;
              break;
            }
            mapped.push_back(static_cast<char>(it->second));
          }
          bytes += all_mapped ? mapped : token;
        }
        tokens = {unicode::utf8_lossy(bytes)};
        break;
      }
      case kByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        auto flush = [&] {
          if (pending.empty()) return;
          std::u32string check;
          if (unicode::decode_utf8(pending, check)) {
            out.push_back(pending);
          } else {
            for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
          }
          pending.clear();
        };
        for (const auto& token : tokens) {
          int byte = -1;
          if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>') {
            try {
              size_t used = 0;
              const int value = std::stoi(token.substr(3, 2), &used, 16);
              if (used == 2 && std::isxdigit(static_cast<unsigned char>(token[3]))) byte = value;
            } catch (const std::exception&) {
            }
          }
          if (byte >= 0) {
            pending.push_back(static_cast<char>(byte));
          } else {
            flush();
            out.push_back(token);
          }
        }
        flush();
        tokens.swap(out);
        break;
      }
      case kFuse: {
        std::string joined;
        for (const auto& token : tokens) joined += token;
        tokens = {joined};
        break;
      }
      case kStrip:
        for (auto& token : tokens) {
          std::u32string chars;
          unicode::decode_utf8(token, chars);
          size_t cut_start = 0, cut_stop = chars.size();
          for (size_t i = 0; i < start && i < chars.size() && chars[i] == strip_char; ++i)
            cut_start = i + 1;
          for (size_t i = 0; i < stop && i < chars.size(); ++i) {
            const size_t index = chars.size() - i - 1;
            if (chars[index] != strip_char) break;
            cut_stop = index;
          }
          token = cut_start < cut_stop ? to_utf8(chars.substr(cut_start, cut_stop - cut_start))
                                       : std::string();
        }
        break;
      case kReplace:
        for (auto& token : tokens) replace_all(token, pattern, content);
        break;
      case kMetaspace:
        // As tokenizers does: every replacement character of the first token is dropped (when
        // a prefix may have been added), the others become spaces.
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::u32string chars;
          unicode::decode_utf8(tokens[i], chars);
          std::u32string decoded;
          for (char32_t c : chars) {
            if (c != strip_char) decoded.push_back(c);
            else if (i != 0 || prepend_scheme == PrependScheme::kNever) decoded.push_back(U' ');
          }
          tokens[i] = to_utf8(decoded);
        }
        break;
    }
  }
};

struct AddedToken {
  int32_t id;
  std::u32string pattern;  // matched in the text: normalized content for normalized tokens
  std::string text;        // what decoding writes
  bool special, lstrip, rstrip, normalized;
};

// Strings a split regex pattern of tokenizer.json holds: {"Regex": ...} or {"String": ...}.
struct Pattern {
  std::string text;
  bool is_regex;
};

Pattern read_pattern(const json& node) {
  if (node.contains("Regex")) return {node["Regex"].get<std::string>(), true};
  if (node.contains("String")) return {node["String"].get<std::string>(), false};
  unsupported("a pattern that is neither Regex nor String");
}

bool flag(const json& node, const char* key, bool fallback) {
  auto it = node.find(key);
  return it == node.end() || it->is_null() ? fallback : it->get<bool>();
}

}  // namespace

struct Tokenizer::Impl {
  // The BPE model.
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> vocab_r;  // id -> token ("" for gaps)
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;  // (a, b) -> (rank, id)
  bool byte_fallback = false, ignore_merges = false, fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_ids[256];

  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<Decoder> decoders;
  bool has_decoder = false;

  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::unordered_set<std::string> special_texts;
  // For each first character, the added tokens starting with it, longest first.
  std::unordered_map<char32_t, std::vector<size_t>> raw_starts, normalized_starts;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void normalize(std::u32string& s) const {
    for (const auto& n : normalizers) n.apply(s);
  }

  // Text pieces and added-token ids, as AddedVocabulary::find_matches splits them.
  struct Segment {
    std::u32string text;
    int32_t id;  // -1: text
  };
  // The added tokens written in `text`, in order, as tokenizers finds them (leftmost, not
  // overlapping). With `parse_special` false a special token's text stays text, as tokenizers'
  // encode_special_tokens makes it.
  std::vector<Segment> split_added(const std::u32string& text,
                                   const std::unordered_map<char32_t, std::vector<size_t>>& starts,
                                   bool parse_special = true) const {
    std::vector<Segment> segments;
    if (starts.empty()) {
      segments.push_back({text, -1});
      return segments;
    }
    size_t offset = 0;
    for (size_t i = 0; i < text.size();) {
      const AddedToken* found = nullptr;
      auto it = starts.find(text[i]);
      if (it != starts.end()) {
        for (size_t index : it->second) {
          const auto& p = added[index].pattern;
          if (text.compare(i, p.size(), p) == 0) {
            found = &added[index];
            break;
          }
        }
      }
      if (!found) {
        ++i;
        continue;
      }
      if (found->special && !parse_special) {
        i += found->pattern.size();
        continue;
      }
      size_t start = i, stop = i + found->pattern.size();
      if (found->lstrip) {
        while (start > offset && unicode::is_white_space(text[start - 1])) --start;
      }
      if (found->rstrip) {
        while (stop < text.size() && unicode::is_white_space(text[stop])) ++stop;
      }
      if (offset < start) segments.push_back({text.substr(offset, start - offset), -1});
      segments.push_back({{}, found->id});
      offset = i = stop;
    }
    if (offset < text.size()) segments.push_back({text.substr(offset), -1});
    return segments;
  }

  void bpe(const std::u32string& word, std::vector<int32_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      auto it = vocab.find(to_utf8(word));
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int prev, next;
      size_t len;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    auto add = [&](int32_t id, size_t len) {
      const int n = static_cast<int>(symbols.size());
      if (n) symbols.back().next = n;
      symbols.push_back({id, n - 1, -1, len});
    };
    int32_t pending_unk = -1;
    size_t pending_len = 0;
    std::string ch;
    for (char32_t c : word) {
      ch.clear();
      unicode::append_utf8(ch, c);
      auto it = vocab.find(ch);
      if (it != vocab.end()) {
        if (pending_unk >= 0) add(pending_unk, pending_len), pending_unk = -1;
        add(it->second, ch.size());
        continue;
      }
      if (byte_fallback &&
          std::all_of(ch.begin(), ch.end(), [&](char b) { return byte_ids[(uint8_t)b] >= 0; })) {
        for (char b : ch) add(byte_ids[static_cast<uint8_t>(b)], 1);
        continue;
      }
      if (unk_id >= 0) {
        if (pending_unk >= 0 && fuse_unk) {
          pending_len += ch.size();
        } else {
          if (pending_unk >= 0) add(pending_unk, pending_len);
          pending_unk = unk_id, pending_len = ch.size();
        }
      }
    }
    if (pending_unk >= 0) add(pending_unk, pending_len);

    // Merge the best-ranked pair first, leftmost on ties; stale queue entries are skipped
    // exactly as tokenizers' Word::merge_all skips them.
    struct Merge {
      size_t pos;
      uint32_t rank;
      int32_t id;
      bool operator<(const Merge& o) const {  // priority_queue pops the "largest"
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Merge> queue;
    auto find = [&](int32_t a, int32_t b) -> const std::pair<uint32_t, int32_t>* {
      auto it = merges.find(pair_key(a, b));
      return it == merges.end() ? nullptr : &it->second;
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i)
      if (auto m = find(symbols[i].id, symbols[i + 1].id)) queue.push({i, m->first, m->second});
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& current = symbols[top.pos];
      if (current.len == 0 || current.next == -1) continue;
      const Symbol right = symbols[current.next];
      auto m = find(current.id, right.id);
      if (!m || m->second != top.id) continue;
      current.id = top.id;
      current.len += right.len;
      symbols[current.next].len = 0;
      current.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = static_cast<int>(top.pos);
      if (current.prev >= 0) {
        if (auto p = find(symbols[current.prev].id, current.id))
          queue.push({static_cast<size_t>(current.prev), p->first, p->second});
      }
      if (current.next >= 0) {
        if (auto n = find(current.id, symbols[current.next].id))
          queue.push({top.pos, n->first, n->second});
      }
    }
    for (const auto& s : symbols)
      if (s.len) out.push_back(s.id);
  }

  // What the model sees of `text`, in order: each added token's id (with piece == nullptr) or
  // each pre-tokenized piece (id -1), as tokenizers' encode produces them.
  template <class Emit>
  void pre_tokenize(const std::u32string& text, const Emit& emit, bool parse_special = true) const {
    bool at_start = true;  // the piece begins the input (Metaspace's "first" scheme asks)
    for (const auto& raw : split_added(text, raw_starts, parse_special)) {
      if (raw.id >= 0) {
        emit(nullptr, raw.id);
        at_start = false;
        continue;
      }
      std::u32string normalized = raw.text;
      normalize(normalized);
      for (const auto& segment : split_added(normalized, normalized_starts, parse_special)) {
        if (segment.id >= 0) {
          emit(nullptr, segment.id);
          at_start = false;
          continue;
        }
        if (segment.text.empty()) continue;  // empty text yields nothing, even with a prefix
        std::vector<Piece> pieces{{segment.text, at_start}}, next;
        at_start = false;
        for (const auto& step : pre_tokenizers) {
          next.clear();
          step.apply(pieces, next);
          pieces.swap(next);
        }
        for (const auto& piece : pieces) emit(&piece.text, -1);
      }
    }
  }

  std::vector<int32_t> encode(const std::u32string& text, bool parse_special) const {
    std::vector<int32_t> ids;
    pre_tokenize(
        text,
        [&](const std::u32string* piece, int32_t id) {
          if (piece) bpe(*piece, ids);
          else ids.push_back(id);
        },
        parse_special);
    return ids;
  }

  // The added token whose text starts at text[i], as split_added matches it (none: nullptr).
  const AddedToken* added_at(const std::u32string& text, size_t i) const {
    auto it = raw_starts.find(text[i]);
    if (it == raw_starts.end()) return nullptr;
    for (size_t index : it->second)
      if (text.compare(i, added[index].pattern.size(), added[index].pattern) == 0)
        return &added[index];
    return nullptr;
  }

  void load(const json& root) {
    load_model(root.at("model"));
    if (root.contains("normalizer") && !root["normalizer"].is_null())
      load_normalizer(root["normalizer"]);
    if (root.contains("pre_tokenizer") && !root["pre_tokenizer"].is_null())
      load_pre_tokenizer(root["pre_tokenizer"]);
    if (root.contains("decoder") && !root["decoder"].is_null()) {
      has_decoder = true;
      load_decoder(root["decoder"]);
    }
    if (root.contains("added_tokens") && root["added_tokens"].is_array())
      for (const auto& token : root["added_tokens"]) load_added(token);
    for (size_t i = 0; i < added.size(); ++i) {
      auto& starts = added[i].normalized ? normalized_starts : raw_starts;
      if (!added[i].pattern.empty()) starts[added[i].pattern[0]].push_back(i);
    }
    for (auto* starts : {&raw_starts, &normalized_starts})
      for (auto& [first, list] : *starts)
        std::stable_sort(list.begin(), list.end(), [&](size_t a, size_t b) {
          return added[a].pattern.size() > added[b].pattern.size();
        });
  }

  void load_model(const json& model) {
    const std::string type = model.value("type", "BPE");
    if (type != "BPE") unsupported("model type " + type + " (only BPE is implemented)");
    if (model.contains("dropout") && !model["dropout"].is_null() &&
        model["dropout"].get<double>() != 0.0)
      unsupported("BPE dropout");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && !model[key].get<std::string>().empty())
        unsupported(std::string("BPE ") + key);
    byte_fallback = flag(model, "byte_fallback", false);
    ignore_merges = flag(model, "ignore_merges", false);
    fuse_unk = flag(model, "fuse_unk", false);
    int32_t max_id = -1;
    for (const auto& [token, id] : model.at("vocab").items()) {
      const auto value = id.get<int32_t>();
      vocab.emplace(token, value);
      max_id = std::max(max_id, value);
    }
    vocab_r.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& [token, id] : vocab) vocab_r[id] = token;
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      auto it = vocab.find(model["unk_token"].get<std::string>());
      if (it == vocab.end()) unsupported("an unk_token that is not in the vocabulary");
      unk_id = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      auto it = vocab.find(name);
      byte_ids[b] = it == vocab.end() ? -1 : it->second;
    }
    uint32_t rank = 0;
    for (const auto& merge : model.at("merges")) {
      std::string a, b;
      if (merge.is_string()) {
        const auto text = merge.get<std::string>();
        const size_t space = text.find(' ');
        if (space == std::string::npos) unsupported("a merge without a space: " + text);
        a = text.substr(0, space), b = text.substr(space + 1);
      } else {
        a = merge.at(0).get<std::string>(), b = merge.at(1).get<std::string>();
      }
      auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
      if (ia == vocab.end() || ib == vocab.end() || ic == vocab.end())
        unsupported("a merge of tokens outside the vocabulary: " + a + " " + b);
      merges.emplace(pair_key(ia->second, ib->second), std::make_pair(rank++, ic->second));
    }
  }

  void load_normalizer(const json& node) {
    const std::string type = node.at("type");
    if (type == "Sequence") {
      for (const auto& step : node.at("normalizers")) load_normalizer(step);
    } else if (type == "NFC") {
      normalizers.push_back({Normalizer::kNFC, {}, {}});
    } else if (type == "Replace") {
      const Pattern p = read_pattern(node.at("pattern"));
      if (p.is_regex) unsupported("Replace normalizer with a regex pattern");
      normalizers.push_back({Normalizer::kReplace, to_u32(p.text), to_u32(node.at("content"))});
    } else if (type == "Prepend") {
      normalizers.push_back({Normalizer::kPrepend, to_u32(node.at("prepend")), {}});
    } else {
      unsupported("normalizer " + type);
    }
  }

  void load_pre_tokenizer(const json& node) {
    const std::string type = node.at("type");
    if (type == "Sequence") {
      for (const auto& step : node.at("pretokenizers")) load_pre_tokenizer(step);
      return;
    }
    PreTokenizer step{};
    if (type == "Digits") {
      step.kind = PreTokenizer::kDigits;
      step.individual_digits = flag(node, "individual_digits", false);
    } else if (type == "ByteLevel") {
      step.kind = PreTokenizer::kByteLevel;
      step.add_prefix_space = flag(node, "add_prefix_space", true);
      step.use_regex = flag(node, "use_regex", true);
      if (step.use_regex) step.regex = std::make_shared<SplitRegex>(kByteLevelPattern);
    } else if (type == "Split") {
      step.kind = PreTokenizer::kSplit;
      const Pattern p = read_pattern(node.at("pattern"));
      if (p.is_regex) step.regex = std::make_shared<SplitRegex>(p.text);
      else step.literal = to_u32(p.text);
      step.behavior = parse_behavior(node.at("behavior"));
      step.invert = flag(node, "invert", false);
    } else if (type == "Metaspace") {
      step.kind = PreTokenizer::kMetaspace;
      step.replacement = metaspace_replacement(node);
      step.prepend_scheme = metaspace_scheme(node);
      step.split = flag(node, "split", true);
    } else {
      unsupported("pre_tokenizer " + type);
    }
    pre_tokenizers.push_back(std::move(step));
  }

  static char32_t metaspace_replacement(const json& node) {
    const auto replacement = to_u32(node.value("replacement", "\u2581"));
    if (replacement.size() != 1) unsupported("Metaspace replacement of more than one character");
    return replacement[0];
  }

  // Files written before prepend_scheme existed say add_prefix_space instead.
  static PrependScheme metaspace_scheme(const json& node) {
    if (node.contains("prepend_scheme")) return parse_prepend_scheme(node["prepend_scheme"]);
    return flag(node, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
  }

  void load_decoder(const json& node) {
    const std::string type = node.at("type");
    Decoder step{};
    if (type == "Sequence") {
      for (const auto& d : node.at("decoders")) load_decoder(d);
      return;
    } else if (type == "ByteLevel") {
      step.kind = Decoder::kByteLevel;
    } else if (type == "ByteFallback") {
      step.kind = Decoder::kByteFallback;
    } else if (type == "Fuse") {
      step.kind = Decoder::kFuse;
    } else if (type == "Strip") {
      step.kind = Decoder::kStrip;
      const auto content = to_u32(node.at("content"));
      if (content.size() != 1) unsupported("Strip decoder content of more than one character");
      step.strip_char = content[0];
      step.start = node.at("start").get<size_t>();
      step.stop = node.at("stop").get<size_t>();
    } else if (type == "Replace") {
      step.kind = Decoder::kReplace;
      const Pattern p = read_pattern(node.at("pattern"));
      if (p.is_regex) unsupported("Replace decoder with a regex pattern");
      step.pattern = p.text;
      step.content = node.at("content").get<std::string>();
    } else if (type == "Metaspace") {
      step.kind = Decoder::kMetaspace;
      step.strip_char = metaspace_replacement(node);
      step.prepend_scheme = metaspace_scheme(node);
    } else {
      unsupported("decoder " + type);
    }
    decoders.push_back(std::move(step));
  }

  void load_added(const json& node) {
    AddedToken token;
    token.id = node.at("id").get<int32_t>();
    const std::string content = node.at("content");
    token.special = flag(node, "special", false);
    token.lstrip = flag(node, "lstrip", false);
    token.rstrip = flag(node, "rstrip", false);
    token.normalized = flag(node, "normalized", !token.special);
    if (flag(node, "single_word", false)) unsupported("single_word added token " + content);
    token.pattern = to_u32(content);
    if (token.normalized) normalize(token.pattern);  // matched (and decoded) in normalized form
    token.text = to_utf8(token.pattern);
    if (token.special) special_texts.insert(token.text);
    added_by_id[token.id] = added.size();
    added.push_back(std::move(token));
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::load(const std::string& tokenizer_json_path) {
  std::ifstream file(tokenizer_json_path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot open " + tokenizer_json_path);
  std::stringstream buffer;
  buffer << file.rdbuf();
  auto impl = std::make_unique<Impl>();
  try {
    impl->load(json::parse(buffer.str()));
  } catch (const json::exception& e) {
    throw std::runtime_error(tokenizer_json_path + ": malformed tokenizer.json: " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(tokenizer_json_path + ": " + e.what());
  }
  return Tokenizer(std::move(impl));
}

namespace {

std::u32string code_points(const std::string& text) {
  std::u32string chars;
  if (!unicode::decode_utf8(text, chars)) throw std::invalid_argument("text is not valid UTF-8");
  return chars;
}

}  // namespace

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool parse_special) const {
  return impl_->encode(code_points(text), parse_special);
}

bool Tokenizer::holds_special(const std::string& text) const {
  for (const auto& special : impl_->special_texts)
    if (text.find(special) != std::string::npos) return true;
  return false;
}

std::vector<int32_t> Tokenizer::encode_framed(const std::string& prefix, const std::string& text,
                                              const std::string& suffix) const {
  // The special tokens the frame wrote are kept (those found in the whole text, as tokenizers
  // finds them, that lie outside the user's text); the runs between them are encoded with
  // special tokens as plain text (mtp_edge/tokenizer.py, _encode_template_specials_only).
  const std::u32string full = code_points(prefix + text + suffix);
  const size_t begin = code_points(prefix).size(), end = begin + code_points(text).size();
  std::vector<int32_t> ids;
  size_t done = 0;
  for (size_t i = 0; i < full.size();) {
    const AddedToken* found = impl_->added_at(full, i);
    if (!found) {
      ++i;
      continue;
    }
    const size_t stop = i + found->pattern.size();
    if (found->special && (stop <= begin || i >= end)) {
      for (int32_t id : impl_->encode(full.substr(done, i - done), false)) ids.push_back(id);
      ids.push_back(found->id);
      done = stop;
    }
    i = stop;
  }
  for (int32_t id : impl_->encode(full.substr(done), false)) ids.push_back(id);
  return ids;
}

std::vector<std::string> Tokenizer::pieces(const std::string& text) const {
  std::vector<std::string> out;
  impl_->pre_tokenize(code_points(text), [&](const std::u32string* piece, int32_t id) {
    out.push_back(piece ? to_utf8(*piece) : impl_->added[impl_->added_by_id.at(id)].text);
  });
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    std::string token;
    auto added = impl_->added_by_id.find(id);
    if (added != impl_->added_by_id.end()) {
      token = impl_->added[added->second].text;
    } else if (id >= 0 && static_cast<size_t>(id) < impl_->vocab_r.size() &&
               !impl_->vocab_r[id].empty()) {
      token = impl_->vocab_r[id];
    } else {
      continue;
    }
    if (impl_->special_texts.count(token)) continue;
    tokens.push_back(std::move(token));
  }
  if (!impl_->has_decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  for (const auto& step : impl_->decoders) step.apply(tokens);
  std::string text;
  for (const auto& token : tokens) text += token;
  return text;
}

int32_t Tokenizer::vocab_size() const {
  int32_t size = static_cast<int32_t>(impl_->vocab_r.size());
  for (const auto& token : impl_->added) size = std::max(size, token.id + 1);
  return size;
}

}  // namespace mtp
