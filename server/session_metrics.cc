#include "server/session_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cmath>

namespace m3 {

SessionMetrics::SessionMetrics(prometheus::Registry& r)
    : open_(&prometheus::BuildGauge()
                 .Name("m3serve_sessions_open")
                 .Help("Converse sessions open: in an engine slot or swapped out between turns")
                 .Register(r)
                 .Add({})),
      swapped_out_(&prometheus::BuildGauge()
                        .Name("m3serve_sessions_swapped_out")
                        .Help("Converse sessions waiting between turns with their state in host memory, holding no slot")
                        .Register(r)
                        .Add({})),
      state_buffers_(&prometheus::BuildGauge()
                          .Name("m3serve_session_state_buffers")
                          .Help("Host buffers kept for swapped-out sessions' states (page-locked on the CUDA "
                                "backend): in use, or spare for the next swap-out")
                          .Register(r)
                          .Add({})),
      state_buffer_bytes_(&prometheus::BuildGauge()
                               .Name("m3serve_session_state_buffer_bytes")
                               .Help("Bytes of the host buffers kept for swapped-out sessions' states")
                               .Register(r)
                               .Add({})),
      swap_ins_(&prometheus::BuildCounter()
                     .Name("m3serve_session_swap_ins_total")
                     .Help("Swapped-out sessions whose state went back into a slot for their next input")
                     .Register(r)
                     .Add({})) {
  // 10 us .. ~5 s, doubling: a state copy is microseconds to milliseconds, a wait for a slot longer.
  prometheus::Histogram::BucketBoundaries bounds;
  for (int i = 0; i < 20; ++i) bounds.push_back(10e-6 * std::ldexp(1.0, i));
  swap_in_seconds_ = &prometheus::BuildHistogram()
                          .Name("m3serve_session_swap_in_seconds")
                          .Help("From a swapped-out session's next input to its state being in a slot again")
                          .Register(r)
                          .Add({}, bounds);
}

void SessionMetrics::set_open(size_t sessions) { open_->Set(static_cast<double>(sessions)); }
void SessionMetrics::set_swapped_out(size_t sessions) { swapped_out_->Set(static_cast<double>(sessions)); }
void SessionMetrics::set_state_buffers(size_t buffers, size_t bytes) {
  state_buffers_->Set(static_cast<double>(buffers));
  state_buffer_bytes_->Set(static_cast<double>(bytes));
}
void SessionMetrics::observe_swap_in(double seconds) {
  swap_ins_->Increment();
  swap_in_seconds_->Observe(seconds);
}

}  // namespace m3
