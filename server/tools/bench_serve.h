// `m3bench serve`: load-tests a running m3serve over gRPC. M requests (Generate, random
// prompts of one length) with N in flight; reports time to first token, inter-token
// latency and request duration (p50/p99, as the client sees them), tokens/s and errors.
#pragma once

namespace m3 {

// argv[0] is the program or the "serve" word; a "serve" right after the program is
// skipped too, so main() may pass its own argc/argv or shift them by one.
// Returns 0 when every request succeeded, 1 when any failed or the server is not
// reachable, 2 on a usage error.
int run_bench_serve(int argc, char** argv);

}  // namespace m3
