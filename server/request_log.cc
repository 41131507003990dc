#include "server/request_log.h"

#include <spdlog/spdlog.h>

namespace m3 {

RequestLog::RequestLog(std::shared_ptr<spdlog::logger> logger, int burst, std::chrono::seconds window)
    : logger_(logger ? std::move(logger) : spdlog::default_logger()), burst_(burst), window_(window) {}

void RequestLog::request_done(const RequestRecord& r) {
  const SequenceSummary& s = r.summary;
  if (r.status == StreamStatus::kOk) {
    logger_->info("{} id={} status=ok tokens_in={} tokens_out={} tokens_sent={} turns={} queue_ms={:.1f} ttft_ms={:.1f} duration_ms={:.1f} finish={} peer={}",
                  r.method, r.request_id, s.prompt_tokens, s.generated_tokens, r.tokens_sent, s.turns,
                  s.queue_ms, s.time_to_first_token_ms, r.duration_ms, s.last_finish ? s.last_finish : "none",
                  r.peer.empty() ? "-" : r.peer);
  } else {
    logger_->info("{} id={} status={} tokens_in={} tokens_out={} tokens_sent={} turns={} queue_ms={:.1f} ttft_ms={:.1f} duration_ms={:.1f} finish={} peer={} error=\"{}\"",
                  r.method, r.request_id, stream_status_name(r.status), s.prompt_tokens,
                  s.generated_tokens, r.tokens_sent, s.turns, s.queue_ms, s.time_to_first_token_ms,
                  r.duration_ms, s.last_finish ? s.last_finish : "none", r.peer.empty() ? "-" : r.peer, r.message);
  }
}

void RequestLog::warn(std::string_view kind, std::string_view message) {
  const auto now = std::chrono::steady_clock::now();
  uint64_t suppressed = 0;
  {
    std::lock_guard lock(mu_);
    auto it = windows_.find(kind);
    if (it == windows_.end()) it = windows_.emplace(std::string(kind), WarnWindow{now}).first;
    WarnWindow& w = it->second;
    if (now - w.start >= window_) {
      suppressed = w.suppressed;
      w = WarnWindow{now};
    }
    if (w.emitted >= burst_) {
      ++w.suppressed;
      return;
    }
    ++w.emitted;
  }
  if (suppressed > 0) {
    logger_->warn("{} ({} similar warnings suppressed in the last {}s)", message, suppressed,
                  window_.count());
  } else {
    logger_->warn("{}", message);
  }
}

}  // namespace m3
