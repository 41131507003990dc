// A float64 decoder for one sequence, written straight from
// ../shared/docs/MAMBA3_MIMO_DECODE.md and sharing no code with the engines: the
// yardstick for model variants the golden files do not cover (untied head, rope
// fraction 1.0, padded vocabulary, MLP without outproj norm, ...).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "model/weights.h"

namespace m3::testing {

class ReferenceDecoder {
 public:
  explicit ReferenceDecoder(const ModelWeights& weights);  // keeps a reference
  // Feeds one token; returns the padded logits.
  std::vector<double> step(int token);
  void reset();

 private:
  struct LayerState {
    std::vector<double> angle, ssm, k_prev, x_prev;
  };
  const std::vector<double>& w(const std::string& name) const;
  std::vector<double> linear(const std::string& name, const std::vector<double>& x) const;
  std::vector<double> mixer(int layer, const std::vector<double>& u);

  ModelConfig c_;
  const ModelWeights& weights_;
  mutable std::map<std::string, std::vector<double>> tensors_;  // widened on first use
  std::vector<LayerState> state_;
};

}  // namespace m3::testing
