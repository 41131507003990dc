// m3make: writes a model directory with random weights of a given config.
//   m3make --config FILE --seed S --dtype bf16|fp32|fp16 --out DIR
// Exit status: 0 written, 1 the config or the output failed, 2 bad arguments.
#include <charconv>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include "model/config.h"
#include "model/random_model.h"

namespace {

constexpr const char* kUsage =
    "usage: m3make --config FILE --seed S --dtype bf16|fp32|fp16 --out DIR\n"
    "  Writes DIR/config.json and DIR/model.safetensors with random weights of the\n"
    "  config in FILE (mamba-ssm MambaConfig layout). Same seed, same files.\n";

int usage_error(const std::string& what) {
  std::fprintf(stderr, "m3make: %s\n%s", what.c_str(), kUsage);
  return 2;
}

bool parse_dtype_arg(std::string_view s, m3::DType* out) {
  if (s == "bf16") *out = m3::DType::BF16;
  else if (s == "fp32" || s == "f32") *out = m3::DType::F32;
  else if (s == "fp16" || s == "f16") *out = m3::DType::F16;
  else return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path, out_dir, seed_text, dtype_text;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::string* target = nullptr;
    if (arg == "--config") target = &config_path;
    else if (arg == "--seed") target = &seed_text;
    else if (arg == "--dtype") target = &dtype_text;
    else if (arg == "--out") target = &out_dir;
    else return usage_error("unknown argument " + std::string(arg));
    if (i + 1 >= argc) return usage_error(std::string(arg) + " needs a value");
    *target = argv[++i];
  }
  uint64_t seed = 0;
  if (!seed_text.empty()) {
    auto [end, ec] = std::from_chars(seed_text.data(), seed_text.data() + seed_text.size(), seed);
    if (ec != std::errc() || end != seed_text.data() + seed_text.size())
      return usage_error("--seed must be a non-negative integer, got \"" + seed_text + "\"");
  }
  m3::DType dtype = m3::DType::BF16;
  if (!dtype_text.empty() && !parse_dtype_arg(dtype_text, &dtype))
    return usage_error("--dtype must be bf16, fp32 or fp16, got \"" + dtype_text + "\"");
  if (config_path.empty()) return usage_error("--config is required");
  if (seed_text.empty()) return usage_error("--seed is required");
  if (dtype_text.empty()) return usage_error("--dtype is required");
  if (out_dir.empty()) return usage_error("--out is required");

  try {
    m3::ModelConfig config = m3::ModelConfig::load(config_path);
    m3::write_random_model(config, seed, dtype, out_dir);
    std::printf("m3make: wrote %s (%lld parameters, %s, seed %llu)\n", out_dir.c_str(),
                static_cast<long long>(config.parameter_count()), dtype_text.c_str(),
                static_cast<unsigned long long>(seed));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3make: %s\n", e.what());
    return 1;
  }
  return 0;
}
