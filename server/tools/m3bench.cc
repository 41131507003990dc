// m3bench: `decode` times the CUDA engine's decode step (no server); `prefill` times
// Engine::prefill() on either backend; `serve` load-tests
// a running m3serve over gRPC (built with the server).
#include <cstring>
#include <iostream>

#include "model/tools/bench_decode.h"
#include "model/tools/bench_prefill.h"
#if defined(M3_WITH_SERVE_BENCH)
#include "server/tools/bench_realtime.h"
#include "server/tools/bench_serve.h"
#endif

namespace {
constexpr const char* kUsage =
    "usage: m3bench decode --config FILE [--batch 1,4,16,64] [--dtype bf16|fp32] [--json OUT]\n"
    "       m3bench prefill --config FILE [--len 128,512,2048,8192] [--batch 1,8] [--backend auto|cuda|cpu]\n"
    "       m3bench serve ...   (load test of a running m3serve; see m3bench serve --help)\n"
    "       m3bench realtime --streams N[,N...] [--rate 100] [--duplex] ...   (streams held in\n"
    "                           real time by a running m3serve; see m3bench realtime --help)\n";
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  if (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::cout << kUsage;
    return 0;
  }
  if (std::strcmp(argv[1], "decode") == 0) return m3::run_bench_decode(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "prefill") == 0) return m3::run_bench_prefill(argc - 1, argv + 1);
  if (std::strcmp(argv[1], "serve") == 0) {
#if defined(M3_WITH_SERVE_BENCH)
    return m3::run_bench_serve(argc - 1, argv + 1);
#else
    std::cerr << "m3bench serve: this build has no gRPC clients (M3_BUILD_SERVER=OFF)\n";
    return 2;
#endif
  }
  if (std::strcmp(argv[1], "realtime") == 0) {
#if defined(M3_WITH_SERVE_BENCH)
    return m3::run_bench_realtime(argc - 1, argv + 1);
#else
    std::cerr << "m3bench realtime: this build has no gRPC clients (M3_BUILD_SERVER=OFF)\n";
    return 2;
#endif
  }
  std::cerr << "m3bench: unknown subcommand \"" << argv[1] << "\"\n" << kUsage;
  return 2;
}
