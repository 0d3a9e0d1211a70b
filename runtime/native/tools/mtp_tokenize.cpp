// mtp-tokenize: encode or decode with a tokenizer.json, for checking the C++ tokenizer against
// the `tokenizers` library and for looking at what a prompt becomes.
//   mtp-tokenize tokenizer.json < text            ids of the whole input, one line
//   mtp-tokenize tokenizer.json --jsonl < lines   each line a JSON string -> one line of ids
//   mtp-tokenize tokenizer.json --decode < lines  each line of ids -> one JSON string
//   mtp-tokenize tokenizer.json --pieces < lines  each line a JSON string -> the JSON list of
//                                                 pieces BPE sees (how the text was split)
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer.h"

namespace {

void print_ids(const std::vector<int32_t>& ids) {
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::cout << line;
}

int run(int argc, char** argv) {
  std::string path, mode = "text";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--jsonl" || arg == "--decode" || arg == "--pieces" || arg == "--vocab-size") {
      mode = arg.substr(2);
    } else if (arg == "-h" || arg == "--help") {
      std::cout << "usage: mtp-tokenize TOKENIZER_JSON [--jsonl | --decode | --pieces | "
                   "--vocab-size]\n";
      return 0;
    } else if (path.empty() && arg.rfind("--", 0) != 0) {
      path = arg;
    } else {
      throw std::runtime_error("unknown argument " + arg + " (see mtp-tokenize --help)");
    }
  }
  if (path.empty()) throw std::runtime_error("give the tokenizer.json path (see --help)");
  const mtp::Tokenizer tokenizer = mtp::Tokenizer::load(path);
  std::ios::sync_with_stdio(false);
  if (mode == "vocab-size") {
    std::cout << tokenizer.vocab_size() << "\n";
  } else if (mode == "text") {
    const std::string text((std::istreambuf_iterator<char>(std::cin)), {});
    print_ids(tokenizer.encode(text));
  } else if (mode == "jsonl") {
    for (std::string line; std::getline(std::cin, line);)
      print_ids(tokenizer.encode(nlohmann::json::parse(line).get<std::string>()));
  } else if (mode == "pieces") {
    for (std::string line; std::getline(std::cin, line);) {
      const auto pieces = tokenizer.pieces(nlohmann::json::parse(line).get<std::string>());
      std::cout << nlohmann::json(pieces).dump() << "\n";
    }
  } else {
    for (std::string line; std::getline(std::cin, line);) {
      std::istringstream fields(line);
      std::vector<int32_t> ids;
      for (int32_t id; fields >> id;) ids.push_back(id);
      // Decoded text may hold U+FFFD but is always valid UTF-8, so dump() cannot throw.
      std::cout << nlohmann::json(tokenizer.decode(ids)).dump() << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
