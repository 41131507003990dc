#include "kernels/plan_policy.h"

namespace m3::kernels {
namespace {

std::string got(const char* field, const char* allowed, int value) {
  return std::string(field) + " must be " + allowed + ", got " + std::to_string(value);
}

}  // namespace

std::string gemv_policy_refusal(const GemvPolicy& p) {
  const int trigger = static_cast<int>(p.trigger);
  if (trigger < 0 || trigger > 2) return got("trigger", "at_end, after_wait or before_wait", trigger);
  if (p.batch1_rows_per_warp != 2 && p.batch1_rows_per_warp != 4) {
    return got("batch1_rows_per_warp", "2 or 4", p.batch1_rows_per_warp);
  }
  if (p.tensor_core_min_batch < 1) return got("tensor_core_min_batch", "at least 1", p.tensor_core_min_batch);
  if (p.row_block_min_batch < 0) return got("row_block_min_batch", "0 (never) or more", p.row_block_min_batch);
  const int ks = p.row_block_cluster, bt = p.row_block_batch_tile;
  if (ks != 0 && ks != 2 && ks != 4 && ks != 8) return got("row_block_cluster", "0 (planned), 2, 4 or 8", ks);
  if (bt != 0 && bt != 8 && bt != 16 && bt != 32 && bt != 64) {
    return got("row_block_batch_tile", "0 (planned), 8, 16, 32 or 64", bt);
  }
  return {};
}

std::string mimo_step_policy_refusal(const MimoStepPolicy& p) {
  const int trigger = static_cast<int>(p.trigger);
  if (trigger < -1 || trigger > 4) return got("trigger", "planned or a point 0 to 4", trigger);
  const int load = static_cast<int>(p.state_load);
  if (load < 0 || load > 2) return got("state_load", "planned, plain or streamed", load);
  const int cs = p.tc_column_split;
  if (cs != 0 && cs != 1 && cs != 2 && cs != 4) return got("tc_column_split", "0 (planned), 1, 2 or 4", cs);
  if (p.small_batch_rows != 8 && p.small_batch_rows != 16) return got("small_batch_rows", "8 or 16", p.small_batch_rows);
  if (p.whole_head_min_batch < 1) return got("whole_head_min_batch", "at least 1", p.whole_head_min_batch);
  if (p.streaming_min_batch < 0) return got("streaming_min_batch", "0 (never) or more", p.streaming_min_batch);
  return {};
}

}  // namespace m3::kernels
