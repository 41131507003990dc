// `m3bench decode`: device time of one decode step of the CUDA engine on random weights,
// per batch size, against the memory floor (bytes the step must move over the
// device-to-device copy bandwidth measured in the same run), with and without the graph.
#pragma once

namespace m3 {

// argv[0] is "decode" (or the program). Returns 0 on success, 1 on failure, 2 on a usage
// error.
int run_bench_decode(int argc, char** argv);

}  // namespace m3
