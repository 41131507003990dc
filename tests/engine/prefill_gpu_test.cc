// prefill() on the CUDA engine against the same engine fed one step() at a time: the
// lengths, model features, several slots in one call and a prompt in pieces that the CPU
// tests cover, within the golden tolerances (fp32 1e-3, bf16 3e-2; the continuation is
// teacher-forced so that a near tie does not cascade). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/weights.h"
#include "prefill_check.h"
#include "test_models.h"

namespace m3 {
namespace {

using testing::PrefillComparison;
using testing::ScratchDir;

struct GpuCase {
  const char* name;
  double rope_fraction;
  bool outproj_norm;
  int d_intermediate;
  WeightDType dtype;
};

void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class CudaPrefill : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
    ModelConfig config = testing::small_config();
    config.ssm.rope_fraction = GetParam().rope_fraction;
    config.ssm.is_outproj_norm = GetParam().outproj_norm;
    config.d_intermediate = GetParam().d_intermediate;
    dir_ = std::make_unique<ScratchDir>(std::string("gpu_prefill_") + GetParam().name);
    testing::write_model(config, dir_->path());
    weights_ = std::make_unique<ModelWeights>(ModelWeights::load(dir_->path()));
  }
  std::unique_ptr<Engine> engine(int slots) {
    EngineOptions o;
    o.max_slots = slots;
    o.weight_dtype = GetParam().dtype;
    o.max_prefill_tokens = 8192;
    o.deterministic = true;
    return make_engine("cuda", *weights_, o);
  }
  void check(PrefillComparison c) {
    const int n = static_cast<int>(c.lengths.size());
    auto stepped = engine(n), prefilled = engine(n);
    c.tolerance = GetParam().dtype == WeightDType::F32 ? 1e-3f : 3e-2f;
    c.compare_samples = false;
    testing::compare_prefill_with_steps(*stepped, *prefilled, c);
  }

  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ModelWeights> weights_;
};

TEST_P(CudaPrefill, EveryLengthAlone) {
  for (int len : {1, 2, 15, 16, 17, 63, 64, 65, 255, 1000, 4097}) {
    SCOPED_TRACE("length " + std::to_string(len));
    PrefillComparison c;
    c.lengths = {len};
    check(c);
  }
}

TEST_P(CudaPrefill, SeveralSlotsInOneCall) {
  PrefillComparison c;
  c.lengths = {1, 17, 300, 64, 129};
  check(c);
}

TEST_P(CudaPrefill, PromptInPieces) {
  PrefillComparison c;
  c.lengths = {300, 1, 77};
  c.pieces = 5;
  check(c);
}

INSTANTIATE_TEST_SUITE_P(
    Features, CudaPrefill,
    ::testing::Values(GpuCase{"fp32_rope_half", 0.5, false, 0, WeightDType::F32},
                      GpuCase{"fp32_rope_full", 1.0, false, 0, WeightDType::F32},
                      GpuCase{"fp32_outproj_norm", 0.5, true, 0, WeightDType::F32},
                      GpuCase{"fp32_mlp", 0.5, false, 100, WeightDType::F32},
                      GpuCase{"bf16_all", 1.0, true, 200, WeightDType::BF16}),
    [](const ::testing::TestParamInfo<GpuCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace m3
