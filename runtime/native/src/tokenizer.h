// tokenizer.json (Hugging Face `tokenizers` format) in C++, token-identical to that library for
// the tokenizers our loaders produce: byte-level BPE (GPT-2 / SmolLM2 digits / Llama 3 / Qwen2
// split regexes, NFC) and SentencePiece-style BPE with byte fallback (as normalizers or as a
// Metaspace pre-tokenizer). Components it does not implement are refused at load time with a
// message naming them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mtp {

class Tokenizer {
 public:
  // Throws std::runtime_error with a message naming the file and what is wrong.
  static Tokenizer load(const std::string& tokenizer_json_path);

  // No bos is added; added tokens written in the text are matched whole, special ones only
  // with parse_special (else they are encoded as the text they are).
  // Throws std::invalid_argument if text is not valid UTF-8.
  std::vector<int32_t> encode(const std::string& text, bool parse_special = true) const;
  // prefix + text + suffix (a chat template around a user's message) with the special tokens
  // of prefix and suffix recognised and those typed inside text encoded as text.
  std::vector<int32_t> encode_framed(const std::string& prefix, const std::string& text,
                                     const std::string& suffix) const;
  // Whether text holds the text of a special token.
  bool holds_special(const std::string& text) const;
  // The pieces BPE sees (normalized and pre-tokenized; added tokens as written), for looking
  // at how a text is split. Throws std::invalid_argument if text is not valid UTF-8.
  std::vector<std::string> pieces(const std::string& text) const;
  // Special tokens are skipped (as `tokenizers` decode(ids, skip_special_tokens=True));
  // unknown ids are ignored; bytes that do not form UTF-8 become U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const;
  // One more than the largest id of the vocabulary and the added tokens.
  int32_t vocab_size() const;

  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mtp
