// JNI bridge from the app's Kotlin object org.mtpedge.demo.Native to the runtime core's C API
// (runtime/native/include/mtp_edge.h). Everything that decides anything lives in the core;
// this file only converts types, streams text to a Kotlin listener and, for the benchmark
// activity, runs prompts through the C API and collects the core's JSON.
//
// Text crosses as UTF-8 byte arrays in both directions: JNI's own string functions speak
// "modified UTF-8", which encodes emoji as surrogate pairs and would corrupt them.
#include <jni.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mtp_edge.h"

namespace {

using json = nlohmann::json;

constexpr size_t kErrorLen = 2048;
constexpr size_t kResultLen = 4 << 20;  // text + token ids + stats of one generation

std::string from_bytes(JNIEnv* env, jbyteArray bytes) {
  if (bytes == nullptr) return {};
  const jsize n = env->GetArrayLength(bytes);
  std::string out(static_cast<size_t>(n), '\0');
  env->GetByteArrayRegion(bytes, 0, n, reinterpret_cast<jbyte*>(out.data()));
  return out;
}

jbyteArray to_bytes(JNIEnv* env, const std::string& text) {
  jbyteArray bytes = env->NewByteArray(static_cast<jsize>(text.size()));
  if (bytes == nullptr) return nullptr;  // OutOfMemoryError is pending
  env->SetByteArrayRegion(bytes, 0, static_cast<jsize>(text.size()),
                          reinterpret_cast<const jbyte*>(text.data()));
  return bytes;
}

// Throws a Java RuntimeException whose message is decoded as real UTF-8.
void throw_runtime(JNIEnv* env, const std::string& message) {
  jclass string_class = env->FindClass("java/lang/String");
  jmethodID string_init = env->GetMethodID(string_class, "<init>", "([BLjava/lang/String;)V");
  jbyteArray bytes = to_bytes(env, message);
  if (bytes == nullptr) return;
  jobject text = env->NewObject(string_class, string_init, bytes, env->NewStringUTF("UTF-8"));
  jclass error_class = env->FindClass("java/lang/RuntimeException");
  jmethodID error_init = env->GetMethodID(error_class, "<init>", "(Ljava/lang/String;)V");
  env->Throw(static_cast<jthrowable>(env->NewObject(error_class, error_init, text)));
}

// A Kotlin object with a method `name(ByteArray)`, called from the core's callbacks.
struct Listener {
  JNIEnv* env;
  jobject target;
  jmethodID method;

  Listener(JNIEnv* e, jobject t, const char* name) : env(e), target(t), method(nullptr) {
    if (target != nullptr) method = env->GetMethodID(env->GetObjectClass(target), name, "([B)V");
  }
  void send(const std::string& text) const {
    // After a Kotlin exception only cleanup is allowed; it is rethrown when the call returns.
    if (method == nullptr || env->ExceptionCheck()) return;
    jbyteArray bytes = to_bytes(env, text);
    if (bytes == nullptr) return;
    env->CallVoidMethod(target, method, bytes);
    env->DeleteLocalRef(bytes);
  }
};

void on_text(const char* piece, void* user) { static_cast<const Listener*>(user)->send(piece); }

// A Kotlin TokenListener: onToken(ByteArray): Boolean, false to stop the answer (the stop
// button). A Kotlin exception stops it too, and is rethrown when the call returns.
struct TokenListener {
  JNIEnv* env;
  jobject target;
  jmethodID method = nullptr;

  TokenListener(JNIEnv* e, jobject t) : env(e), target(t) {
    if (target != nullptr)
      method = env->GetMethodID(env->GetObjectClass(target), "onToken", "([B)Z");
  }
  int on_token(const char* piece) const {
    if (method == nullptr) return MTP_CONTINUE;
    if (env->ExceptionCheck()) return MTP_STOP;
    jbyteArray bytes = to_bytes(env, piece);
    if (bytes == nullptr) return MTP_STOP;
    const jboolean go_on = env->CallBooleanMethod(target, method, bytes);
    env->DeleteLocalRef(bytes);
    return go_on && !env->ExceptionCheck() ? MTP_CONTINUE : MTP_STOP;
  }
};

int on_token(int32_t, const char* piece, void* user) {
  return static_cast<const TokenListener*>(user)->on_token(piece);
}

mtp_chat* chat_of(jlong handle) { return reinterpret_cast<mtp_chat*>(handle); }

mtp_engine* engine_of(jlong handle) { return reinterpret_cast<mtp_engine*>(handle); }

// One generation through the C API; the core's result JSON, or the core's error.
bool generate(mtp_engine* engine, const std::string& prompt, const std::string& options,
              const Listener* listener, std::string& result, std::string& error) {
  std::vector<char> out(kResultLen), err(kErrorLen);
  const int status = mtp_generate(engine, prompt.c_str(), options.c_str(),
                                  listener ? on_text : nullptr, const_cast<Listener*>(listener),
                                  out.data(), out.size(), err.data(), err.size());
  if (status != 0) {
    error = err.data();
    return false;
  }
  result = out.data();
  return true;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// The prompt file format of mtp-runner --prompts: {"id", "category", "prompt",
// "max_new_tokens"} per line.
std::vector<json> read_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the prompts file " + path);
  std::vector<json> rows;
  int line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json row = json::parse(line, nullptr, false);
    if (row.is_discarded() || !row.is_object() || !row.contains("prompt"))
      throw std::runtime_error(path + ":" + std::to_string(line_number) +
                               ": expected a JSON object with a \"prompt\"");
    rows.push_back(std::move(row));
  }
  if (rows.empty()) throw std::runtime_error(path + " holds no prompts");
  return rows;
}

// A metric row as ExecuTorch's minibench app writes them (BenchmarkMetric).
json metric(const json& model, const std::string& name, double value) {
  return {{"benchmarkModel", model}, {"metric", name}, {"actualValue", value},
          {"targetValue", 0.0}};
}

// Plain then speculative greedy decoding of every prompt, `repeat` times, on one engine: every
// run's result as the core reports it, and minibench-style summary metrics.
json benchmark(const std::string& bundle_dir, const std::string& prompts_path, int repeat,
               int max_new_tokens, const json& device, const Listener& progress) {
  const auto prompts = read_prompts(prompts_path);
  std::vector<char> err(kErrorLen);
  const auto load_start = std::chrono::steady_clock::now();
  const std::unique_ptr<mtp_engine, decltype(&mtp_close)> engine(
      mtp_open(bundle_dir.c_str(), err.data(), err.size()), &mtp_close);
  if (engine == nullptr) throw std::runtime_error(err.data());
  const double load_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - load_start)
          .count();

  json runs = json::array();
  std::vector<double> plain_rate, spec_rate, tau, acceptance;
  int identical = 0, compared = 0;
  for (int r = 0; r < repeat; ++r) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      const json& row = prompts[i];
      std::vector<json> pair;
      for (const bool speculative : {false, true}) {
        const json options = {
            {"max_new_tokens", row.value("max_new_tokens", max_new_tokens)},
            {"speculative", speculative},
            {"temperature", 0.0},
            {"chat", true}};
        std::string result, error;
        if (!generate(engine.get(), row["prompt"].get<std::string>(), options.dump(), nullptr,
                      result, error))
          throw std::runtime_error("prompt " + row.value("id", std::to_string(i)) + ": " + error);
        json parsed = json::parse(result);
        const json& stats = parsed["stats"];
        (speculative ? spec_rate : plain_rate).push_back(stats.value("decode_tokens_per_s", 0.0));
        if (speculative) {
          tau.push_back(stats.value("tau", 0.0));
          acceptance.push_back(stats.value("acceptance_rate", 0.0));
        }
        pair.push_back(parsed);
        runs.push_back({{"id", row.value("id", std::to_string(i))},
                        {"category", row.value("category", "")},
                        {"repeat", r},
                        {"speculative", speculative},
                        {"result", std::move(parsed)}});
      }
      ++compared;
      if (pair[0]["token_ids"] == pair[1]["token_ids"]) ++identical;
      progress.send("repeat " + std::to_string(r + 1) + "/" + std::to_string(repeat) +
                    ", prompt " + std::to_string(i + 1) + "/" + std::to_string(prompts.size()));
    }
  }

  const std::string name = bundle_dir.substr(bundle_dir.find_last_of('/') + 1);
  const json model = {{"name", name}, {"backend", "xnnpack"}, {"quantization", ""}};
  const double plain = median(plain_rate), spec = median(spec_rate);
  json metrics = json::array({
      metric(model, "load_status", 0.0),
      metric(model, "llm_model_load_time(ms)", load_ms),
      metric(model, "plain_token_per_sec", plain),
      metric(model, "token_per_sec", spec),
      metric(model, "speedup", plain > 0 ? spec / plain : 0.0),
      metric(model, "tau", median(tau)),
      metric(model, "acceptance_rate", median(acceptance)),
      metric(model, "greedy_identical_fraction",
             compared ? static_cast<double>(identical) / compared : 0.0),
  });
  for (auto& m : metrics) m["deviceInfo"] = device;
  return {{"bundle", bundle_dir},
          {"prompts", prompts_path},
          {"repeat", repeat},
          {"device", device},
          {"metrics", std::move(metrics)},
          {"runs", std::move(runs)}};
}

}  // namespace

extern "C" {

JNIEXPORT jlong JNICALL Java_org_mtpedge_demo_Native_open(JNIEnv* env, jclass,
                                                          jbyteArray bundle_dir) {
  std::vector<char> err(kErrorLen);
  mtp_engine* engine = mtp_open(from_bytes(env, bundle_dir).c_str(), err.data(), err.size());
  if (engine == nullptr) throw_runtime(env, err.data());
  return reinterpret_cast<jlong>(engine);
}

JNIEXPORT void JNICALL Java_org_mtpedge_demo_Native_close(JNIEnv*, jclass, jlong handle) {
  mtp_close(engine_of(handle));
}

// The core's result JSON as UTF-8 ({"text", "stop_reason", "token_ids", "stats", ...}), with
// each piece of text passed to listener.onText(ByteArray) as it is generated.
JNIEXPORT jbyteArray JNICALL Java_org_mtpedge_demo_Native_generate(JNIEnv* env, jclass,
                                                                   jlong handle,
                                                                   jbyteArray prompt,
                                                                   jbyteArray options_json,
                                                                   jobject listener) {
  const Listener text_listener(env, listener, "onText");
  if (env->ExceptionCheck()) return nullptr;  // the listener has no onText(ByteArray)
  std::string result, error;
  const bool ok = generate(engine_of(handle), from_bytes(env, prompt),
                           from_bytes(env, options_json), &text_listener, result, error);
  if (env->ExceptionCheck()) return nullptr;  // thrown by the listener: let Kotlin see it
  if (!ok) {
    throw_runtime(env, error);
    return nullptr;
  }
  return to_bytes(env, result);
}

// Keeps a request log in dir (mtp_request_log; empty: logging stops): the core's result JSON
// as UTF-8 ({"log", "seeded_requests", "store_tokens", ...}).
JNIEXPORT jbyteArray JNICALL Java_org_mtpedge_demo_Native_requestLog(JNIEnv* env, jclass,
                                                                     jlong handle,
                                                                     jbyteArray dir,
                                                                     jbyteArray options_json) {
  std::vector<char> out(kErrorLen), err(kErrorLen);
  const int status = mtp_request_log(engine_of(handle), from_bytes(env, dir).c_str(),
                                     from_bytes(env, options_json).c_str(), out.data(),
                                     out.size(), err.data(), err.size());
  if (status != MTP_OK) {
    throw_runtime(env, err.data());
    return nullptr;
  }
  return to_bytes(env, out.data());
}

// A conversation on the engine (mtp_chat_create); an empty system prompt: the template's.
JNIEXPORT jlong JNICALL Java_org_mtpedge_demo_Native_chatCreate(JNIEnv* env, jclass,
                                                                jlong handle,
                                                                jbyteArray system_prompt) {
  std::vector<char> err(kErrorLen);
  mtp_chat* chat = mtp_chat_create(engine_of(handle), from_bytes(env, system_prompt).c_str(),
                                   err.data(), err.size());
  if (chat == nullptr) throw_runtime(env, err.data());
  return reinterpret_cast<jlong>(chat);
}

JNIEXPORT void JNICALL Java_org_mtpedge_demo_Native_chatFree(JNIEnv*, jclass, jlong chat) {
  mtp_chat_free(chat_of(chat));
}

JNIEXPORT void JNICALL Java_org_mtpedge_demo_Native_chatReset(JNIEnv*, jclass, jlong chat) {
  mtp_chat_reset(chat_of(chat));
}

// Adds the user's message: true, or false when the context is full (reset the conversation).
JNIEXPORT jboolean JNICALL Java_org_mtpedge_demo_Native_chatAddUser(JNIEnv* env, jclass,
                                                                    jlong chat,
                                                                    jbyteArray text) {
  std::vector<char> err(kErrorLen);
  const int status =
      mtp_chat_add_user(chat_of(chat), from_bytes(env, text).c_str(), err.data(), err.size());
  if (status == MTP_ERROR) throw_runtime(env, err.data());
  return status == MTP_OK;
}

// The answer's result JSON as UTF-8 (mtp_chat_generate), each piece of text passed to
// listener.onToken(ByteArray) as it is generated; onToken returning false stops the answer.
JNIEXPORT jbyteArray JNICALL Java_org_mtpedge_demo_Native_chatGenerate(JNIEnv* env, jclass,
                                                                       jlong chat,
                                                                       jbyteArray options_json,
                                                                       jobject listener) {
  const TokenListener token_listener(env, listener);
  if (env->ExceptionCheck()) return nullptr;  // the listener has no onToken(ByteArray): Boolean
  std::vector<char> out(kResultLen), err(kErrorLen);
  const int status = mtp_chat_generate(chat_of(chat), from_bytes(env, options_json).c_str(),
                                       on_token, const_cast<TokenListener*>(&token_listener),
                                       out.data(), out.size(), err.data(), err.size());
  if (env->ExceptionCheck()) return nullptr;  // thrown by the listener: let Kotlin see it
  if (status != MTP_OK) {
    throw_runtime(env, err.data());
    return nullptr;
  }
  return to_bytes(env, out.data());
}

// The benchmark report as UTF-8 JSON; progress.onProgress(ByteArray) after each prompt.
JNIEXPORT jbyteArray JNICALL Java_org_mtpedge_demo_Native_benchmark(
    JNIEnv* env, jclass, jbyteArray bundle_dir, jbyteArray prompts_path, jint repeat,
    jint max_new_tokens, jbyteArray device_json, jobject progress) {
  const Listener progress_listener(env, progress, "onProgress");
  if (env->ExceptionCheck()) return nullptr;
  try {
    json device = json::parse(from_bytes(env, device_json), nullptr, false);
    if (device.is_discarded()) device = json::object();
    const json report = benchmark(from_bytes(env, bundle_dir), from_bytes(env, prompts_path),
                                  std::max(1, static_cast<int>(repeat)),
                                  std::max(1, static_cast<int>(max_new_tokens)), device,
                                  progress_listener);
    if (env->ExceptionCheck()) return nullptr;
    return to_bytes(env, report.dump(2, ' ', false, json::error_handler_t::replace));
  } catch (const std::exception& e) {
    if (!env->ExceptionCheck()) throw_runtime(env, e.what());
    return nullptr;
  }
}

}  // extern "C"
