// mtp-logits: the logits of a program's calls, as the native core makes them, written raw so
// that they can be compared bit for bit across calls and across machines (the ARM64 build
// under qemu against the x86 one). Reads one JSON object on stdin:
//   {"program": PTE, "max_seq_len": N, "max_chunk": C, "vocab": V, "row_exact": true,
//    "sessions": [[{"tokens": [...], "start": S, "prefill": false}, ...], ...]}
// Each session is a fresh model (its own KV cache); each call is a forward of `tokens` at
// `start` (with "prefill": true, the whole list in chunks of max_chunk, last row only). Writes
// the logits of every call, in order, as little-endian float32 to argv[1], and prints one JSON
// line: the number of rows of each call.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "llama_ops.h"
#include "model.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: mtp-logits OUT.f32 < calls.json\n");
    return 2;
  }
  try {
    const nlohmann::json spec = nlohmann::json::parse(std::cin);
    mtp::register_llama_ops();
    std::ofstream out(argv[1], std::ios::binary);
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& calls : spec.at("sessions")) {
      auto model = mtp::open_executorch_model(
          spec.at("program"), spec.at("max_seq_len"), spec.at("max_chunk"), spec.at("vocab"),
          spec.value("row_exact", true));
      nlohmann::json session_rows = nlohmann::json::array();
      for (const auto& call : calls) {
        const std::vector<int64_t> tokens = call.at("tokens");
        const int64_t start = call.value("start", 0);
        const mtp::Output o = call.value("prefill", false)
                                  ? mtp::prefill(*model, tokens, start, false)
                                  : model->forward(tokens, start, false);
        out.write(reinterpret_cast<const char*>(o.logits.data()),
                  static_cast<std::streamsize>(o.logits.size() * sizeof(float)));
        session_rows.push_back(o.rows);
      }
      rows.push_back(session_rows);
    }
    if (!out) throw std::runtime_error(std::string("cannot write ") + argv[1]);
    std::cout << nlohmann::json{{"rows", rows}}.dump() << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
