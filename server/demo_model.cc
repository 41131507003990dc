#include "server/demo_model.h"

#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <system_error>

#include "model/random_model.h"

namespace m3 {
namespace {

// The same shape as configs/models/tiny.json, embedded so the binary needs no files.
constexpr const char* kDemoConfigJson = R"({
  "d_model": 128, "d_intermediate": 0, "n_layer": 2, "vocab_size": 512,
  "ssm_cfg": {"layer": "Mamba3", "is_mimo": true, "mimo_rank": 4, "d_state": 32,
              "headdim": 32, "expand": 2, "ngroups": 1, "rope_fraction": 0.5,
              "is_outproj_norm": false},
  "rms_norm": true, "residual_in_fp32": true, "fused_add_norm": true,
  "pad_vocab_size_multiple": 8, "tie_embeddings": true
})";
constexpr uint64_t kDemoSeed = 20261130;
constexpr const char* kDemoDirName = "demo-tiny-v1";

std::filesystem::path default_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return std::filesystem::path(x) / "m3serve";
  if (const char* h = std::getenv("HOME"); h && *h)
    return std::filesystem::path(h) / ".cache" / "m3serve";
  return std::filesystem::temp_directory_path() / "m3serve";
}

}  // namespace

ModelConfig demo_model_config() { return ModelConfig::parse(kDemoConfigJson, "<demo model config>"); }

std::filesystem::path ensure_demo_model(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path root = dir.empty() ? default_cache_dir() : fs::path(dir);
  const fs::path target = root / kDemoDirName;
  if (fs::exists(target / "config.json") && fs::exists(target / "model.safetensors")) return target;

  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw std::runtime_error("demo model: cannot create " + root.string() + ": " + ec.message());
  const fs::path staging = root / (std::string(kDemoDirName) + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(staging, ec);
  write_random_model(demo_model_config(), kDemoSeed, DType::F32, staging);
  fs::rename(staging, target, ec);
  if (ec) {
    // Another server won the race: use its copy.
    fs::remove_all(staging, ec);
    if (!fs::exists(target / "model.safetensors"))
      throw std::runtime_error("demo model: cannot move it into " + target.string());
  }
  return target;
}

}  // namespace m3
