// The operands of every gemv kernel (GemvArgs with the weight typed): the first part of
// each kernel's parameter block, so the kernels share one definition of them.
#pragma once

#include "kernels/gemv.cuh"
#include "kernels/launch.cuh"

namespace m3::kernels {

template <typename W>
struct GemvOperands {
  const W* weight;  // [rows, cols] row-major
  int out_rows, cols;
  const float* x;   // [batch, x_stride]
  int x_stride;
  const float* norm_weight;  // [cols] or nullptr
  float norm_eps;
  float* y;         // [batch, y_stride]
  int y_stride;
  int batch;
  int trigger_point;  // pdl_trigger_point(PdlStage::Gemv)
};

template <typename W>
GemvOperands<W> gemv_operands(const GemvArgs& a) {
  return GemvOperands<W>{static_cast<const W*>(a.weight), a.out_rows, a.cols, a.x, a.x_stride,
                         a.norm_weight, a.norm_eps, a.y, a.y_stride, a.batch,
                         pdl_trigger_point(PdlStage::Gemv)};
}

}  // namespace m3::kernels
