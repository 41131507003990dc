// A model directory (config.json + safetensors) opened and checked against its config:
// every tensor the config needs is present with the right shape and a float dtype,
// and nothing surplus is left over. Tensor data stays in the mapped files.
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "model/config.h"
#include "model/safetensors.h"

namespace m3 {

// Checkpoint names (mamba-ssm MambaLMHeadModel).
std::string layer_tensor_name(int layer, const std::string& suffix);  // "backbone.layers.3." + suffix

class ModelWeights {
 public:
  // Errors carry context, e.g. "model.safetensors: tensor backbone.layers.3.mixer.D has
  // shape [16], config needs [28]".
  static ModelWeights load(const std::filesystem::path& model_dir);

  const ModelConfig& config() const { return config_; }
  const std::filesystem::path& dir() const { return dir_; }
  // Throws if absent. Layer tensors: layer(i, "mixer.in_proj.weight").
  const TensorView& tensor(const std::string& name) const;
  const TensorView& layer(int i, const std::string& suffix) const;
  // lm_head.weight, or the embedding when tied and lm_head.weight is not stored.
  const TensorView& lm_head() const;
  // Every tensor of the checkpoint by name (a model's fingerprint hashes them all).
  const std::map<std::string, const TensorView*>& all_tensors() const { return set_.tensors(); }

 private:
  ModelConfig config_;
  std::filesystem::path dir_;
  SafetensorsSet set_;
};

}  // namespace m3
