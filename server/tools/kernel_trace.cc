// m3_kernel_trace: a CUDA injection library (load it with CUDA_INJECTION64_PATH) that
// records the start and end of every kernel through CUPTI's activity API, the nodes of a
// replayed CUDA graph included, and writes them as CSV at exit to $M3_TRACE_OUT (default
// kernel_trace.csv). No change to the traced program: the driver loads the library at
// initialisation and calls InitializeInjection. scripts/kernel_trace_summary.py turns the
// CSV of an m3bench decode run into per-layer times inside the graph.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>

namespace {

FILE* out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{64} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    std::fprintf(out, "%llu,%llu,%d,%d,%d,%u,%s\n", static_cast<unsigned long long>(k->start),
                 static_cast<unsigned long long>(k->end), k->gridX, k->gridY, k->blockX, k->graphId, k->name);
  }
  std::free(buffer);
}

void flush_at_exit() {
  cuptiActivityFlushAll(1);
  std::fclose(out);
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("M3_TRACE_OUT");
  out = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (out == nullptr) return 0;
  std::fprintf(out, "start_ns,end_ns,grid_x,grid_y,block_x,graph,name\n");
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "m3_kernel_trace: CUPTI activity tracing unavailable\n");
    return 0;
  }
  std::atexit(flush_at_exit);
  return 1;
}
