// mtp-runner: plain vs speculative decoding of a prompt suite on a bundle, natively; writes the
// mtp-bench JSON report. The same arguments on the host and on a phone (mtp-profile drives it).
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <executorch/runtime/platform/platform.h>

#include "engine.h"
#include "errors.h"
#include "suite.h"

namespace {

const char* kUsage =
    "usage: mtp-runner --bundle DIR (--prompts FILE.jsonl | --prompt TEXT | --prompt-ids 1,2,3)\n"
    "       [--max-new-tokens N] [--repeat R] [--json OUT|-] [--k K]\n"
    "       [--drafter none|ngram|mtp|draft-lm|mtp+ngram|draft-lm+ngram]\n"
    "       [--ngram-sizes MIN-MAX]\n"
    "       [--draft-confidence P] [--adaptive-k] [--fallback] [--no-fallback]\n"
    "       [--fallback-costs VERIFY_MS,SLOPE,DRAFT_MS] [--no-chat-template] [--threads N]\n"
    "       [--no-weight-cache]\n"
    "       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop TEXT]...\n"
    "       [--record-drafts] [--store] [--store-log DIR]\n"
    "Each prompt runs plain, then speculative; greedy output must be identical (exit 1 if not).\n"
    "Short names as the Python commands: -p --prompt, -n --max-new-tokens, -s --seed,\n"
    "-t --threads, --temp --temperature.\n"
    "--json OUT: write the report there (- or no --json: on stdout).\n"
    "--drafter (as mtp-run --drafter; default: the bundle's drafter, behind a prompt lookup\n"
    "when the bundle says so): X+ngram is prompt lookup (--ngram-sizes, default 1-3 or the\n"
    "bundle's) where the context repeats itself, the bundle's model drafter X elsewhere.\n"
    "--k: 1..15 (default: the bundle's; an 8da8w bundle's at most 3 on a CPU without an int8\n"
    "dot product, e.g. AVX2); --draft-confidence: in [0, 1) (default: the bundle's).\n"
    "--fallback: draft each step only as many tokens as measured acceptance and costs say pay\n"
    "(as mtp-run --fallback; off by default). --fallback-costs: the fallback reads these fixed\n"
    "costs instead of timings (a call of width w: VERIFY_MS * (1 + SLOPE * (w - 1)); a drafted\n"
    "token of a model drafter DRAFT_MS, of a lookup 0), so that runs decide alike.\n"
    "--stop TEXT (repeatable): stop a run once its generated text contains TEXT, keeping the\n"
    "token that completes it (as mtp-run --stop; stop_reason \"stop_string\").\n"
    "--record-drafts: each prompt's report row gets spec_drafts, the tokens drafted at each\n"
    "verify step of its speculative run, and spec_steps, [drafted, accepted] per verify step.\n"
    "--store: speculative runs draft also from the prompts run before (prompt and answer: the\n"
    "store of past requests of the Python commands' --adapt): where the model drafter (with\n"
    "--drafter ngram the lookup; an X+ngram lookup's drafts stay as they are) stops short of\n"
    "k, the most frequent continuation of the context's last 4, 3 or 2 tokens in them goes on.\n"
    "Each prompt enters the store after its last repeat; the report gets store_tokens,\n"
    "store_requests, store_drafts, and each row store_extended. --store-log DIR: the store\n"
    "starts with the requests of a request log (--log DIR of mtp-serve and mtp-chat, or one of\n"
    "its files), as mtp-serve --adapt --log DIR seeds it; implies --store.\n"
    "--no-weight-cache: XNNPACK packs weights once per method instead of once per program\n"
    "(more memory; as MTP_XNNPACK_WEIGHT_CACHE=0).\n"
    "prompts file: one JSON per line, {\"id\", \"category\", \"prompt\" or \"prompt_ids\",\n"
    "\"max_new_tokens\"}; prompt_ids are fed as is (no chat format, no bos added).\n";

template <typename T>
T number(const std::string& flag, const std::string& text) {
  std::istringstream in(text);
  T value;
  if (!(in >> value) || !in.eof())
    throw mtp::UserError(flag + " takes a number, got '" + text + "'");
  return value;
}

// A count or seed: digits only (an unsigned parse would read "-1" as 2^64 - 1).
template <typename T>
T natural(const std::string& flag, const std::string& text, const std::string& range) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0])))
    throw mtp::UserError(flag + " must be in " + range + ", got '" + text + "'");
  return number<T>(flag, text);
}

double finite(const std::string& flag, const std::string& text) {
  const double value = number<double>(flag, text);
  if (!std::isfinite(value)) throw mtp::UserError(flag + " must be a finite number, got " + text);
  return value;
}

// "VERIFY_MS,SLOPE,DRAFT_MS", each finite and >= 0, VERIFY_MS > 0.
mtp::CostModel parse_costs(const std::string& flag, const std::string& text) {
  std::vector<double> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) parts.push_back(finite(flag, part));
  if (parts.size() != 3 || !(parts[0] > 0) || parts[1] < 0 || parts[2] < 0)
    throw mtp::UserError(flag + " takes VERIFY_MS,SLOPE,DRAFT_MS (VERIFY_MS > 0, the others >= "
                         "0) such as 10,0.1,1, got '" + text + "'");
  return {parts[0], parts[1], parts[2]};
}

// Fail before any work: OUT must be a file that can be written where it is (mtp_edge/files.py
// check_output: its directory made, a probe file written and removed there).
void check_output(const std::string& flag, const std::string& path) {
  if (path.empty() || path == "-") return;
  namespace fs = std::filesystem;
  std::error_code error;
  if (fs::is_directory(path, error))
    throw mtp::UserError(flag + " " + path + " is a directory: give a file name");
  const fs::path parent = fs::absolute(path, error).parent_path();
  const std::string probe = (parent / ("." + fs::path(path).filename().string() + ".probe")).string();
  fs::create_directories(parent, error);
  std::ofstream out(probe, std::ios::binary);
  out << "probe";
  out.close();
  const bool written = bool(out);
  std::remove(probe.c_str());
  if (!written)
    throw mtp::UserError(flag + " " + path + ": cannot write in " + parent.string() +
                         ": choose another path");
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) ids.push_back(number<int64_t>("--prompt-ids", part));
  return ids;
}

// ExecuTorch's info lines (CPU probing, thread pool size) would bury the runner's progress on
// stderr; its errors still come through.
void quiet_executorch_info(et_timestamp_t, et_pal_log_level_t level, const char*, const char*,
                           size_t, const char* message, size_t length) {
  if (level == kError || level == kFatal)
    std::fprintf(stderr, "executorch: %.*s\n", int(length), message);
}

void write_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    if (!out) throw mtp::UserError("cannot write " + path);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw mtp::UserError("cannot write " + path);
}

int run(int argc, char** argv) {
  std::string bundle, prompts_path, prompt_text, prompt_ids, json_out;
  mtp::EngineOptions engine_options;
  mtp::SuiteOptions options;
  int64_t k = -1;
  std::string store_log;
  std::string command = "mtp-runner";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw mtp::UserError(flag + " needs a value (see --help)");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (flag == "--bundle") {
      bundle = value();
    } else if (flag == "--prompts") {
      prompts_path = value();
    } else if (flag == "--prompt" || flag == "-p") {
      prompt_text = value();
    } else if (flag == "--prompt-ids") {
      prompt_ids = value();
    } else if (flag == "--max-new-tokens" || flag == "-n") {
      options.max_new_tokens = natural<int64_t>(flag, value(), ">= 1");
      if (options.max_new_tokens < 1) throw mtp::UserError("--max-new-tokens must be >= 1");
    } else if (flag == "--repeat") {
      options.repeat = natural<int>(flag, value(), ">= 1");
      if (options.repeat < 1) throw mtp::UserError("--repeat must be >= 1");
    } else if (flag == "--json") {
      json_out = value();
    } else if (flag == "--k") {
      k = number<int64_t>(flag, value());
      if (k < 1 || k > 15) throw mtp::UserError("--k takes 1..15 (most tokens drafted per step)");
    } else if (flag == "--drafter") {
      engine_options.drafter = value();
    } else if (flag == "--ngram-sizes") {
      std::tie(engine_options.ngram_min, engine_options.ngram_max) =
          mtp::parse_ngram_sizes(value(), flag);
      if (!(1 <= engine_options.ngram_min && engine_options.ngram_min <= engine_options.ngram_max))
        throw mtp::UserError("--ngram-sizes needs 1 <= MIN <= MAX, got min " +
                             std::to_string(engine_options.ngram_min) + ", max " +
                             std::to_string(engine_options.ngram_max));
      engine_options.ngram_sizes_given = true;
    } else if (flag == "--draft-confidence") {
      engine_options.draft_confidence = finite(flag, value());
      if (!(engine_options.draft_confidence >= 0 && engine_options.draft_confidence < 1))
        throw mtp::UserError("--draft-confidence must be in [0, 1)");
      engine_options.draft_confidence_given = true;
    } else if (flag == "--adaptive-k") {
      options.config.adaptive_k = true;
    } else if (flag == "--fallback" || flag == "--no-fallback") {
      options.config.fallback = flag == "--fallback";
    } else if (flag == "--fallback-costs") {
      options.config.cost_model = parse_costs(flag, value());
    } else if (flag == "--record-drafts") {
      options.record_drafts = true;
    } else if (flag == "--store") {
      engine_options.store = true;
    } else if (flag == "--store-log") {
      store_log = value();
      engine_options.store = true;
    } else if (flag == "--no-chat-template" || flag == "--no-chat") {  // --no-chat: older name
      options.chat = false;
    } else if (flag == "--threads" || flag == "-t") {
      engine_options.threads = natural<unsigned>(flag, value(), ">= 0 (0 = all cores)");
    } else if (flag == "--no-weight-cache") {
      mtp::set_xnnpack_weight_cache(false);
    } else if (flag == "--temperature" || flag == "--temp") {
      options.config.sampling.temperature = finite(flag, value());
      if (!(options.config.sampling.temperature >= 0))
        throw mtp::UserError("--temperature must be a finite number >= 0 (0 = greedy)");
    } else if (flag == "--top-k") {
      options.config.sampling.top_k = natural<int>(flag, value(), ">= 0 (0 = off)");
    } else if (flag == "--top-p") {
      options.config.sampling.top_p = finite(flag, value());
      if (!(options.config.sampling.top_p > 0 && options.config.sampling.top_p <= 1))
        throw mtp::UserError("--top-p must be in (0, 1] (1 = off)");
    } else if (flag == "--seed" || flag == "-s") {
      options.config.sampling.seed =
          natural<uint64_t>(flag, value(), "0..18446744073709551615 (64 bits)");
    } else if (flag == "--stop") {
      options.config.stop_strings.push_back(value());
      if (options.config.stop_strings.back().empty())
        throw mtp::UserError("--stop takes a non-empty text");
    } else {
      throw mtp::UserError("unknown option " + flag + " (see --help)");
    }
  }
  if (bundle.empty()) throw mtp::UserError("--bundle DIR is required (see --help)");
  const int sources = !prompts_path.empty() + !prompt_text.empty() + !prompt_ids.empty();
  if (sources != 1)
    throw mtp::UserError("give exactly one of --prompts FILE, --prompt TEXT, --prompt-ids IDS");

  std::vector<mtp::Prompt> prompts;
  if (!prompts_path.empty()) {
    prompts = mtp::load_prompts(prompts_path);
  } else {
    mtp::Prompt p{"prompt", "default", prompt_text, 128, {}};
    if (!prompt_ids.empty()) p.ids = parse_ids(prompt_ids);
    prompts.push_back(p);
  }
  check_output("--json", json_out);
  if (!store_log.empty() && !std::filesystem::exists(store_log))
    throw mtp::UserError("--store-log " + store_log + " does not exist: give the folder a "
                         "request log was written to (--log DIR)");
  {  // What the manifest alone answers, before the programs load (the engine checks again).
    const mtp::Manifest manifest = mtp::Manifest::load(bundle, /*verify=*/false);
    if (engine_options.drafter) mtp::check_drafter_name(*engine_options.drafter,
                                                        manifest.drafter_kind());
    for (const mtp::Prompt& p : prompts) {
      try {
        mtp::check_token_ids(p.ids, manifest.vocab_size);
      } catch (const mtp::UserError& e) {
        throw mtp::UserError((prompts_path.empty() ? "--prompt-ids: " : "prompt " + p.id + ": ") +
                             e.what());
      }
    }
  }
  std::cerr << "[load] " << bundle << std::endl;
  mtp::Engine engine(bundle, engine_options);
  if (!options.config.stop_strings.empty() && !engine.has_tokenizer())
    throw mtp::UserError("--stop needs the bundle's tokenizer.json, which " + bundle + " lacks");
  options.config.k = k >= 0 ? k : engine.manifest().k_for_this_cpu();
  if (k < 0 && options.config.k != engine.manifest().default_k()) {
    const std::string given = std::to_string(engine.manifest().default_k());
    std::cerr << "[k] " << options.config.k << " tokens drafted per step, not the bundle's "
              << given << ": ";
    if (engine.manifest().own_kernels()) {
      std::cerr << "its " << engine.manifest().target_scheme()
                << " layers verify up to 6 tokens in one pass over the weights";
    } else {
      const mtp::Int8Path path = mtp::host_int8_path();
      std::cerr << "this CPU (" << path.name << ") has no int8 dot product and verifies up to "
                << engine.manifest().tile_rows() << " tokens in one pass over the weights";
    }
    std::cerr << " (--k " << given << " to draft " << given << ")" << std::endl;
  }
  engine.check_k(options.config.k);
  options.config.eos_ids = engine.manifest().eos_ids;
  if (engine_options.store) options.store = &engine.store();
  if (!store_log.empty()) {
    const int64_t seeded = engine.seed_store(store_log);
    std::cerr << "[store] " << seeded << " requests (" << engine.store().tokens()
              << " tokens kept) from " << store_log << std::endl;
  }
  nlohmann::json body = mtp::run_suite(engine, prompts, options, [](const std::string& line) {
    std::cerr << line << std::endl;
  });
  nlohmann::json report = {
      {"bundle", bundle},
      {"model", engine.manifest().model_name},
      {"backend", "executorch"},
      {"runtime", "native"},
      {"drafter", engine.drafter_name()},
      {"k", options.config.k},
      {"threads", engine_options.threads},
      {"weight_cache", mtp::xnnpack_weight_cache()},
      {"temperature", options.config.sampling.temperature},
      {"command", command},
  };
  if (engine_options.store) report.update(mtp::store_json(engine.store()));
  report.update(body);
  const std::string text =
      report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (json_out.empty() || json_out == "-")
    std::cout << text;
  else
    write_atomic(json_out, text);
  const auto& s = report["summary"];
  std::cerr << "plain " << s["ar_tokens_per_s"] << " tok/s, speculative "
            << s["spec_tokens_per_s"] << " tok/s, speedup " << s["speedup"] << ", tau "
            << s["tau"] << ", lossless " << s["lossless"] << std::endl;
  if (options.config.sampling.greedy() && !s["lossless"].get<bool>())
    throw std::runtime_error(  // a fault of ours: exit 1, as the Python commands
        "speculative output diverged from plain output beyond a near-tie: a bug");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::register_pal(
      executorch::runtime::PalImpl::create(quiet_executorch_info, __FILE__));
  try {
    return run(argc, argv);
  } catch (const mtp::UserError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
