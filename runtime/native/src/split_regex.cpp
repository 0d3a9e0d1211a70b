#include "split_regex.h"

#include <bitset>
#include <stdexcept>

#include "unicode.h"

namespace mtp {
namespace {

using unicode::Category;

// One member of a character class: a range, a set of general categories, or \s.
struct ClassItem {
  enum Kind { kRange, kCategories, kSpace } kind = kRange;
  char32_t lo = 0, hi = 0;
  uint32_t categories = 0;
  bool negated = false;

  bool matches(char32_t c) const {
    bool m = false;
    switch (kind) {
      case kRange: m = c >= lo && c <= hi; break;
      case kCategories: m = (categories >> unicode::category(c)) & 1u; break;
      case kSpace: m = unicode::is_white_space(c); break;
    }
    return m != negated;
  }
};

struct CharSet {
  std::vector<ClassItem> items;
  bool negated = false;
  bool icase = false;
  std::bitset<128> ascii;  // the answer for ASCII, precomputed

  bool any_item(char32_t c) const {
    for (const auto& item : items)
      if (item.matches(c)) return true;
    return false;
  }
  bool contains_slow(char32_t c) const {
    bool m = any_item(c);
    if (!m && icase)
      for (char32_t x : unicode::fold_equivalents(c))
        if (any_item(x)) m = true;
    return m != negated;
  }
  void finish() {
    for (char32_t c = 0; c < 128; ++c) ascii[c] = contains_slow(c);
  }
  bool contains(char32_t c) const { return c < 128 ? ascii[c] : contains_slow(c); }
};

uint32_t bit(Category c) { return 1u << c; }

uint32_t category_mask(const std::string& name) {
  using namespace unicode;
  const uint32_t letter = bit(Lu) | bit(Ll) | bit(Lt) | bit(Lm) | bit(Lo);
  const uint32_t mark = bit(Mn) | bit(Mc) | bit(Me);
  const uint32_t number = bit(Nd) | bit(Nl) | bit(No);
  const uint32_t punct = bit(Pc) | bit(Pd) | bit(Ps) | bit(Pe) | bit(Pi) | bit(Pf) | bit(Po);
  const uint32_t symbol = bit(Sm) | bit(Sc) | bit(Sk) | bit(So);
  const uint32_t separator = bit(Zs) | bit(Zl) | bit(Zp);
  const uint32_t other = bit(Cc) | bit(Cf) | bit(Cs) | bit(Co) | bit(Cn);
  if (name == "L" || name == "Letter") return letter;
  if (name == "M" || name == "Mark") return mark;
  if (name == "N" || name == "Number") return number;
  if (name == "P" || name == "Punctuation") return punct;
  if (name == "S" || name == "Symbol") return symbol;
  if (name == "Z" || name == "Separator") return separator;
  if (name == "C" || name == "Other") return other;
  if (name == "LC" || name == "L&") return bit(Lu) | bit(Ll) | bit(Lt);
  static const char* const kNames[] = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl",
                                       "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc",
                                       "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"};
  for (int i = 0; i < kCategoryCount; ++i)
    if (name == kNames[i]) return 1u << i;
  return 0;
}

}  // namespace

struct SplitRegex::Node {
  enum Kind { kSet, kAlt, kRepeat, kLook } kind = kSet;
  CharSet set;                          // kSet
  std::vector<std::vector<Node>> alts;  // kAlt: the branches; kLook and kRepeat: alts[0]
  int min = 1, max = 1;                 // kRepeat; max < 0: unbounded
  bool greedy = true;                   // kRepeat
  bool negative = false;                // kLook
};

namespace {

using Node = SplitRegex::Node;
using Seq = std::vector<Node>;

class Parser {
 public:
  explicit Parser(const std::string& pattern) : source_(pattern) {
    if (!unicode::decode_utf8(pattern, p_)) fail("the pattern is not valid UTF-8");
  }

  Node parse() {
    Node root = alternation(false);
    if (i_ != p_.size()) fail("unbalanced ')'");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("unsupported split regex " + source_ + ": " + what +
                             " (at character " + std::to_string(i_) + ")");
  }
  bool at_end() const { return i_ >= p_.size(); }
  char32_t peek(size_t ahead = 0) const { return i_ + ahead < p_.size() ? p_[i_ + ahead] : 0; }

  Node alternation(bool icase) {
    Node node;
    node.kind = Node::kAlt;
    node.alts.push_back(sequence(icase));
    while (!at_end() && peek() == '|') {
      ++i_;
      node.alts.push_back(sequence(icase));
    }
    return node;
  }

  Seq sequence(bool icase) {
    Seq seq;
    while (!at_end() && peek() != '|' && peek() != ')') {
      Node atom_node = atom(icase);
      seq.push_back(quantified(std::move(atom_node)));
    }
    return seq;
  }

  Node quantified(Node atom_node) {
    int min, max;
    const char32_t c = peek();
    if (c == '?') {
      min = 0, max = 1, ++i_;
    } else if (c == '*') {
      min = 0, max = -1, ++i_;
    } else if (c == '+') {
      min = 1, max = -1, ++i_;
    } else if (c == '{') {
      ++i_;
      min = number();
      max = min;
      if (peek() == ',') {
        ++i_;
        max = peek() == '}' ? -1 : number();
      }
      if (peek() != '}') fail("malformed {n,m} quantifier");
      ++i_;
      if (max >= 0 && max < min) fail("quantifier {n,m} with m < n");
    } else {
      return atom_node;
    }
    Node node;
    node.kind = Node::kRepeat;
    node.min = min, node.max = max;
    if (peek() == '?') {
      node.greedy = false, ++i_;
    } else if (peek() == '+') {
      fail("possessive quantifiers");
    }
    if (atom_node.kind == Node::kLook) fail("a quantified lookahead");
    node.alts.push_back(Seq{std::move(atom_node)});
    if (peek() == '?' || peek() == '*' || peek() == '+' || peek() == '{') fail("nested quantifiers");
    return node;
  }

  int number() {
    if (!(peek() >= '0' && peek() <= '9')) fail("expected a number in {n,m}");
    int n = 0;
    while (peek() >= '0' && peek() <= '9') n = n * 10 + static_cast<int>(peek() - '0'), ++i_;
    return n;
  }

  Node atom(bool icase) {
    const char32_t c = p_[i_++];
    switch (c) {
      case '(': return group(icase);
      case '[': return char_class(icase);
      case '.': {
        ClassItem newline;
        newline.lo = newline.hi = '\n';
        return set_node({newline}, true, false);
      }
      case '\\': {
        ClassItem item = escape();
        return set_node({item}, false, icase);
      }
      case '^': case '$': fail("anchors");
      case '*': case '+': case '?': case '{': fail("a quantifier with nothing to repeat");
      default: {
        ClassItem item;
        item.lo = item.hi = c;
        return set_node({item}, false, icase);
      }
    }
  }

  static Node set_node(std::vector<ClassItem> items, bool negated, bool icase) {
    Node node;
    node.kind = Node::kSet;
    node.set.items = std::move(items);
    node.set.negated = negated;
    node.set.icase = icase;
    node.set.finish();
    return node;
  }

  Node group(bool icase) {
    Node node;
    if (peek() == '?') {
      ++i_;
      const char32_t kind = at_end() ? 0 : p_[i_++];
      if (kind == ':') {
        node = alternation(icase);
      } else if (kind == 'i' && peek() == ':') {
        ++i_;
        node = alternation(true);
      } else if (kind == '=' || kind == '!') {
        Node inner = alternation(icase);
        node.kind = Node::kLook;
        node.negative = kind == '!';
        node.alts.push_back(Seq{std::move(inner)});
      } else {
        fail("only (?:...), (?i:...), (?=...) and (?!...) groups are supported");
      }
    } else {
      node = alternation(icase);  // a capturing group: captures are not used
    }
    if (peek() != ')') fail("missing ')'");
    ++i_;
    return node;
  }

  // After a backslash: a class escape (\s, \p{L}, ...) or one character as a range.
  ClassItem escape() {
    if (at_end()) fail("a trailing backslash");
    const char32_t c = p_[i_++];
    ClassItem item;
    switch (c) {
      case 's': case 'S':
        item.kind = ClassItem::kSpace, item.negated = c == 'S';
        return item;
      case 'd': case 'D':
        item.kind = ClassItem::kCategories, item.categories = bit(unicode::Nd);
        item.negated = c == 'D';
        return item;
      case 'p': case 'P': {
        if (peek() != '{') fail("\\p without {name}");
        ++i_;
        bool negated = c == 'P';
        if (peek() == '^') negated = !negated, ++i_;
        std::string name;
        while (!at_end() && peek() != '}') unicode::append_utf8(name, p_[i_++]);
        if (at_end()) fail("unterminated \\p{");
        ++i_;
        item.kind = ClassItem::kCategories;
        item.categories = category_mask(name);
        if (!item.categories) fail("unknown property \\p{" + name + "}");
        item.negated = negated;
        return item;
      }
      case 'n': item.lo = '\n'; break;
      case 'r': item.lo = '\r'; break;
      case 't': item.lo = '\t'; break;
      case 'f': item.lo = '\f'; break;
      case 'v': item.lo = '\v'; break;
      case 'a': item.lo = 0x07; break;
      case 'e': item.lo = 0x1B; break;
      case 'x': item.lo = hex(peek() == '{' ? 0 : 2); break;
      case 'u': item.lo = hex(4); break;
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
          fail(std::string("the escape \\") + static_cast<char>(c));
        item.lo = c;  // an escaped punctuation character stands for itself
    }
    item.hi = item.lo;
    return item;
  }

  // `digits` hex digits, or {hex...} when digits == 0.
  char32_t hex(int digits) {
    const bool braced = digits == 0;
    if (braced) ++i_;
    char32_t value = 0;
    int n = 0;
    while (!at_end() && (braced || n < digits)) {
      const char32_t h = peek();
      int d;
      if (h >= '0' && h <= '9') d = static_cast<int>(h - '0');
      else if (h >= 'a' && h <= 'f') d = static_cast<int>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') d = static_cast<int>(h - 'A' + 10);
      else break;
      value = value * 16 + d, ++i_, ++n;
    }
    if (n == 0 || (!braced && n != digits)) fail("a malformed hex escape");
    if (braced) {
      if (peek() != '}') fail("a malformed \\x{...} escape");
      ++i_;
    }
    return value;
  }

  Node char_class(bool icase) {
    bool negated = false;
    if (peek() == '^') negated = true, ++i_;
    std::vector<ClassItem> items;
    bool first = true;
    while (true) {
      if (at_end()) fail("an unterminated [class]");
      char32_t c = p_[i_++];
      if (c == ']' && !first) break;
      first = false;
      if (c == '[') fail("nested classes");
      if (c == '&' && peek() == '&') fail("class intersection");
      ClassItem item;
      if (c == '\\') {
        item = escape();
        if (item.kind != ClassItem::kRange) {
          items.push_back(item);
          continue;
        }
      } else {
        item.lo = item.hi = c;
      }
      if (peek() == '-' && peek(1) != ']' && peek(1) != 0) {
        ++i_;
        char32_t hi = p_[i_++];
        if (hi == '\\') {
          ClassItem end = escape();
          if (end.kind != ClassItem::kRange) fail("a range ending in a class escape");
          hi = end.lo;
        } else if (hi == '[') {
          fail("nested classes");
        }
        if (hi < item.lo) fail("a reversed range");
        item.hi = hi;
      }
      items.push_back(item);
    }
    return set_node(std::move(items), negated, icase);
  }

  std::string source_;
  std::u32string p_;
  size_t i_ = 0;
};

// A non-owning reference to a continuation `bool(size_t end)`: no allocation per call.
class Cont {
 public:
  template <class F>
  Cont(const F& f)  // NOLINT: implicit on purpose, lambdas are passed directly
      : obj_(&f), call_([](const void* o, size_t p) { return (*static_cast<const F*>(o))(p); }) {}
  bool operator()(size_t p) const { return call_(obj_, p); }

 private:
  const void* obj_;
  bool (*call_)(const void*, size_t);
};

// Backtracking matcher: match `seq` from node i at text position pos, then run k.
class Matcher {
 public:
  explicit Matcher(const std::u32string& text) : text_(text) {}

  bool seq(const Seq& s, size_t i, size_t pos, Cont k) const {
    if (i == s.size()) return k(pos);
    auto rest = [&](size_t p) { return seq(s, i + 1, p, k); };
    return node(s[i], pos, rest);
  }

  bool node(const Node& n, size_t pos, Cont k) const {
    switch (n.kind) {
      case Node::kSet:
        return pos < text_.size() && n.set.contains(text_[pos]) && k(pos + 1);
      case Node::kAlt:
        for (const auto& branch : n.alts)
          if (seq(branch, 0, pos, k)) return true;
        return false;
      case Node::kLook: {
        auto accept = [](size_t) { return true; };
        const bool found = seq(n.alts[0], 0, pos, accept);
        return found != n.negative && k(pos);
      }
      case Node::kRepeat:
        return repeat(n, pos, k);
    }
    return false;
  }

 private:
  bool repeat(const Node& n, size_t pos, Cont k) const {
    const Node& child = n.alts[0][0];
    if (child.kind != Node::kSet) return repeat_general(n, 0, pos, k);
    // One character per iteration: count the run, then back off without recursion.
    const size_t limit =
        n.max < 0 ? text_.size() : std::min(text_.size(), pos + static_cast<size_t>(n.max));
    size_t end = pos;
    while (end < limit && child.set.contains(text_[end])) ++end;
    const size_t count = end - pos, min = static_cast<size_t>(n.min);
    if (count < min) return false;
    if (n.greedy) {
      for (size_t c = count;; --c) {
        if (k(pos + c)) return true;
        if (c == min) return false;
      }
    }
    for (size_t c = min; c <= count; ++c)
      if (k(pos + c)) return true;
    return false;
  }

  bool repeat_general(const Node& n, int count, size_t pos, Cont k) const {
    auto more = [&](size_t p) { return p != pos && repeat_general(n, count + 1, p, k); };
    const bool can_more = n.max < 0 || count < n.max;
    if (n.greedy) {
      if (can_more && seq(n.alts[0], 0, pos, more)) return true;
      return count >= n.min && k(pos);
    }
    if (count >= n.min && k(pos)) return true;
    return can_more && seq(n.alts[0], 0, pos, more);
  }

  const std::u32string& text_;
};

}  // namespace

SplitRegex::SplitRegex(const std::string& pattern)
    : root_(std::make_unique<Node>(Parser(pattern).parse())) {}
SplitRegex::~SplitRegex() = default;
SplitRegex::SplitRegex(SplitRegex&&) noexcept = default;
SplitRegex& SplitRegex::operator=(SplitRegex&&) noexcept = default;

std::vector<std::pair<size_t, size_t>> SplitRegex::find_all(const std::u32string& text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  Matcher matcher(text);
  size_t pos = 0, end = 0;
  auto record = [&](size_t p) { return end = p, true; };
  while (pos < text.size()) {
    if (matcher.node(*root_, pos, record) && end > pos) {
      matches.emplace_back(pos, end);
      pos = end;
    } else {
      ++pos;  // no match here (or an empty one): search from the next character
    }
  }
  return matches;
}

}  // namespace mtp
