// The sampling kernel with masks against its CPU twin (sample_token over the mask's
// ranges at the slot's frame position, model/cpu/cpu_sampling.h): mixed masks, positions,
// input and continue tokens; and the units-only property over 10,000 hot draws, the
// frame positions carried on the device from launch to launch.
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/sampling.cuh"
#include "kernels/token_mask.h"
#include "model/cpu/cpu_sampling.h"
#include "model/sampling_mask.h"
#include "model/vocab_layout.h"

namespace m3 {
namespace {

using testing::DeviceArray;

// vocab 997: text [0, 600), 4 codebooks of 90 units at [600, 960) in frame order
// 2, 0, 3, 1, controls at 980.. (and one text piece).
VocabLayout test_layout() {
  VocabLayout v;
  v.text = TextVocab{0, 600, {}};
  v.speech_units = SpeechUnitVocab{600, 4, 90, {2, 0, 3, 1}};
  v.controls = {{"bos", 3}, {"end_of_turn", 980}, {"end_of_reply", 981}, {"pad", 990}};
  return v;
}

struct DeviceMasks {
  explicit DeviceMasks(const SamplingMaskTable& t)
      : first_position(t.first_position()), period(t.period()), range_begin(t.range_begin()), ranges(t.flat_ranges()) {
    view.first_position = first_position.get();
    view.period = period.get();
    view.range_begin = range_begin.get();
    view.ranges = ranges.get();
    view.n_masks = t.size();
  }
  DeviceArray<int32_t> first_position, period, range_begin;
  DeviceArray<TokenRange> ranges;
  TokenMaskView view;
};

// One launch over `batch` rows; checks every sample, last token, counter and frame
// position against the host twin, and returns the samples.
std::vector<int32_t> expect_masked_samples(const SamplingMaskTable& table, const DeviceMasks& masks,
                                           const std::vector<float>& logits, int stride, int vocab,
                                           const std::vector<int32_t>& slots, const std::vector<int32_t>& tokens,
                                           const std::vector<kernels::SlotSampling>& params,
                                           std::vector<uint64_t>& counters, std::vector<int32_t>& positions) {
  const int batch = static_cast<int>(slots.size()), n_slots = static_cast<int>(params.size());
  DeviceArray<float> dl(logits);
  DeviceArray<int32_t> dslots(slots), dtokens(tokens), dlast(std::vector<int32_t>(n_slots, -5)), dsampled(batch);
  DeviceArray<int32_t> dpositions(positions);
  DeviceArray<kernels::SlotSampling> dparams(params);
  DeviceArray<uint64_t> dcounters(counters);
  kernels::SamplingArgs a;
  a.logits = dl.get();
  a.logits_stride = stride;
  a.vocab = vocab;
  a.slots = dslots.get();
  a.params = dparams.get();
  a.counters = dcounters.get();
  a.last_token = dlast.get();
  a.sampled = dsampled.get();
  a.batch = batch;
  a.masks = masks.view;
  a.tokens = dtokens.get();
  a.frame_positions = dpositions.get();
  kernels::plan_sampling(a).launch(nullptr, false);
  M3_CUDA_CHECK(cudaDeviceSynchronize());
  const auto sampled = dsampled.download();
  const auto positions_after = dpositions.download();
  SamplingScratch scratch(vocab);
  for (int b = 0; b < batch; ++b) {
    const int s = slots[b];
    SamplingParams hp{params[s].temperature, params[s].top_k, params[s].top_p, params[s].seed, params[s].mask};
    int position = positions[s];
    std::span<const TokenRange> allowed;
    if (hp.mask >= 0) {
      if (tokens[b] != -1) position = 0;
      allowed = table.ranges(hp.mask, position);
    }
    const int32_t want = sample_token(std::span<const float>(logits.data() + b * stride, stride), vocab, hp,
                                      counters[s], scratch, allowed);
    EXPECT_EQ(sampled[b], want) << "entry " << b << " mask " << hp.mask << " position " << position;
    if (hp.mask >= 0) {
      EXPECT_EQ(positions_after[s], next_frame_position(table.view(), hp.mask, position, want)) << "entry " << b;
    } else {
      EXPECT_EQ(positions_after[s], positions[s]) << "an unmasked slot keeps its position";
    }
    ++counters[s];
  }
  positions = positions_after;
  return sampled;
}

TEST(SamplingKernelMasks, MatchHostDefinition) {
  M3_REQUIRE_CUDA_DEVICE();
  const int vocab = 997, stride = 1003, n_slots = 6;
  const std::vector<SamplingMask> mask_list = sampling_masks_for(test_layout());
  const SamplingMaskTable table(mask_list, vocab);
  ASSERT_EQ(table.size(), 4);  // text, text_and_controls, units, units_and_controls
  const DeviceMasks masks(table);
  const std::vector<SamplingParams> cases = {
      {0.f, 0, 1.f, 1}, {1.f, 0, 1.f, 2}, {0.7f, 40, 1.f, 3}, {1.3f, 0, 0.9f, 4}, {1.5f, 20, 0.8f, 5},
  };
  std::vector<uint64_t> counters(n_slots, 0);
  std::vector<int32_t> positions(n_slots, 0);
  for (int round = 0; round < 16; ++round) {
    const std::vector<int32_t> slots = {4, 0, 5, 2, 1};
    std::vector<float> logits = testing::random_floats(slots.size() * stride, 500 + round, -4.f, 4.f);
    for (size_t b = 0; b < slots.size(); ++b)
      for (int i = vocab; i < stride; ++i) logits[b * stride + i] = 100.f;  // padding, never picked
    std::vector<kernels::SlotSampling> params(n_slots);
    for (int s = 0; s < n_slots; ++s) {
      const SamplingParams& c = cases[(s + round) % cases.size()];
      params[s] = {c.temperature, c.top_k, c.top_p, (s + round / 4) % 5 - 1, c.seed * 31 + s};
    }
    // Every few rounds an input token resets the frame; otherwise slots continue.
    std::vector<int32_t> tokens(slots.size(), -1);
    if (round % 5 == 0) tokens[round % slots.size()] = 17;
    expect_masked_samples(table, masks, logits, stride, vocab, slots, tokens, params, counters, positions);
  }
}

TEST(SamplingKernelMasks, UnitsOnlyYieldsNoOtherTokenIn10000HotDraws) {
  M3_REQUIRE_CUDA_DEVICE();
  const int vocab = 997, stride = 1000, batch = 8;
  const VocabLayout layout = test_layout();
  const std::vector<SamplingMask> mask_list = sampling_masks_for(layout);
  const SamplingMaskTable table(mask_list, vocab);
  const DeviceMasks masks(table);
  std::vector<kernels::SlotSampling> params(batch);
  for (int s = 0; s < batch; ++s) params[s] = {1.5f, 0, 1.f, 2 /* units */, 1234u + static_cast<uint64_t>(s)};
  std::vector<uint64_t> counters(batch, 0);
  std::vector<int32_t> positions(batch, 0);
  std::vector<int32_t> slots(batch);
  for (int s = 0; s < batch; ++s) slots[s] = s;
  int draws = 0;
  for (int step = 0; step < 1250; ++step) {
    // Logits that favour text and controls: only the mask keeps them out.
    std::vector<float> logits = testing::random_floats(static_cast<size_t>(batch) * stride, 9000 + step, -2.f, 2.f);
    for (int b = 0; b < batch; ++b) {
      for (int i = 0; i < 600; i += 3) logits[b * stride + i] += 6.f;
      for (int i = 960; i < vocab; ++i) logits[b * stride + i] += 8.f;
    }
    const std::vector<int32_t> tokens(batch, step == 0 ? 5 : -1);
    const std::vector<int32_t> sampled =
        expect_masked_samples(table, masks, logits, stride, vocab, slots, tokens, params, counters, positions);
    for (int b = 0; b < batch; ++b) {
      ASSERT_TRUE(layout.speech_units->contains(sampled[b])) << "step " << step << " slot " << b << ": " << sampled[b];
      ASSERT_EQ(layout.speech_units->codebook_of(sampled[b]), layout.speech_units->frame_order[step % 4])
          << "step " << step;
      ++draws;
    }
  }
  EXPECT_EQ(draws, 10000);
}

}  // namespace
}  // namespace m3
