// Which chunk kernels a prefill scan call takes, decided on the host from the head shape
// and layout alone (so a model runs the same kernels at every call). Internal to the
// prefill scan (kernels/prefill_chunk.cuh and the tests include it); the interface is
// kernels/prefill_scan.cuh.
#pragma once

#include "kernels/prefill_scan.cuh"

namespace m3::kernels::prefill_detail {

// The chunk state and chunk output kernels on register fragments (kernels/prefill_chunk_*_tc.cu):
// for bf16 operands, MIMO heads, d_state a multiple of 32, rank 1, 2, 4 or 8, an even number
// of angles, in_proj rows and x/z offsets a multiple of four floats, 16-byte aligned
// parameters and a shared-memory plan under kMaxSharedBytesPerBlock; the general kernels
// in prefill_scan.cu take every other case.
bool chunk_tc_applies(const PrefillScanArgs& a);
// The shared memory one block of the chunk output (output) or state kernel asks for at this
// head shape, in bytes.
int chunk_tc_smem_bytes(const PrefillScanDims& d, bool output);

}  // namespace m3::kernels::prefill_detail
