// `m3bench realtime`: how many speech streams a running m3serve keeps ahead of real time.
// For each N of --streams, N streams run at once, each reading its reply at --rate tokens/s
// (a client that paces its reads, as a player would); a stream holds when every token k
// of its reply arrived by its start + k/rate + --slack-ms. --duplex makes each stream a
// spoken conversation (Converse turns whose input arrives at the same rate in 8-token
// frames, then a reply) and reports the turn latency too. Prints per N whether every
// stream held, the lag p50/p99 and the largest N that held; --json writes it all.
#pragma once

namespace m3 {

// argv[0] is the program or the "realtime" word (skipped, as run_bench_serve does).
// Returns 0 when every N was measured (held or not), 1 when the server is unreachable or
// the JSON cannot be written, 2 on a usage error.
int run_bench_realtime(int argc, char** argv);

}  // namespace m3
