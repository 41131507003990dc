// `m3bench prefill`: how long Engine::prefill() takes to read prompts of given lengths in
// batches of given sizes, on random weights of a model config, against reading the same
// tokens one decode step at a time (the step timed in the same run) and against the floor:
// the matrix products' FLOPs over a matrix rate measured in the same run, or the bytes the
// prefill must move over the copy bandwidth measured in the same run, whichever is larger.
#pragma once

namespace m3 {

// argv[0] is "prefill". Returns 0 on success, 1 on failure, 2 on a usage error.
int run_bench_prefill(int argc, char** argv);

}  // namespace m3
