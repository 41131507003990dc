#include "test_models.h"

#include <atomic>
#include <unistd.h>

#include "model/random_model.h"
#include "model/tensor.h"

namespace m3::testing {

ScratchDir::ScratchDir(const std::string& tag) {
  static std::atomic<int> serial{0};
  path_ = std::filesystem::temp_directory_path() /
          ("m3_engine_test_" + tag + "_" + std::to_string(::getpid()) + "_" +
           std::to_string(serial++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

ModelConfig small_config() {
  ModelConfig c;
  c.d_model = 64;
  c.n_layer = 2;
  c.vocab_size = 203;
  c.d_intermediate = 0;
  c.pad_vocab_size_multiple = 8;
  c.tie_embeddings = true;
  c.ssm.layer = "Mamba3";
  c.ssm.is_mimo = true;
  c.ssm.mimo_rank = 2;
  c.ssm.d_state = 16;
  c.ssm.headdim = 16;
  c.ssm.expand = 2;
  c.ssm.rope_fraction = 0.5;
  c.ssm.is_outproj_norm = false;
  return c;
}

std::filesystem::path write_model(const ModelConfig& config, const std::filesystem::path& dir,
                                  uint64_t seed) {
  write_random_model(config, seed, DType::F32, dir);
  return dir;
}

}  // namespace m3::testing
