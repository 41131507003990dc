// Small random models and scratch directories for the engine tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "model/config.h"

namespace m3::testing {

// A fresh directory under the system temp dir, removed with everything in it on
// destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// MIMO, 2 layers, d_model 64, N 16, P 16, R 2, rope 0.5, tied, no MLP, no outproj norm,
// vocab 203 (padded to 208): tests switch single features on from here.
ModelConfig small_config();

// Writes config.json and random fp32 weights into dir (created if needed); returns dir.
std::filesystem::path write_model(const ModelConfig& config, const std::filesystem::path& dir,
                                  uint64_t seed = 7);

}  // namespace m3::testing
