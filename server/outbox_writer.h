// The writer half shared by the stream reactors (Generate, Converse): turns what a
// Sequence's outbox holds into one response message at a time (tokens coalesced into one
// Tokens message, then a turn end), and remembers a failed write (the call is gone):
// after that nothing more is written, but the outbox is still drained to its close.
// It counts the tokens it writes (m3serve_tokens_generated_total): tokens the outbox
// drops (a slow reader's, or at an error) never reach the client and are not counted.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "server/metrics.h"
#include "server/sequence.h"
#include "server/service_context.h"

namespace m3 {

template <class Response>
class OutboxWriter {
 public:
  explicit OutboxWriter(const ServiceContext& ctx) : metrics_(ctx.metrics) {
    if (ctx.tokenizer) detokenizer_ = std::make_unique<StreamDetokenizer>(*ctx.tokenizer);
    tokens_.reserve(ctx.stream_buffer_tokens);
  }

  // Takes the outbox's next items until one makes a message, which goes to write(response)
  // (a gRPC write; its completion calls drain again), or the stream is closed, which goes
  // to close(status, message), or nothing is left (the flusher calls again when there is).
  // fill_turn_end(const TurnEnd&, Response*) writes a turn end into the response.
  template <class FillTurnEnd, class Write, class Close>
  void drain(Sequence& seq, FillTurnEnd&& fill_turn_end, Write&& write, Close&& close) {
    for (;;) {
      TokenOutbox::Item item = seq.outbox().take(&tokens_);
      switch (item.kind) {
        case TokenOutbox::Item::kNothing:
          return;
        case TokenOutbox::Item::kTokens:
          if (write_failed_) continue;
          fill_tokens(tokens_, detokenizer_.get(), &text_, response_.mutable_tokens());
          // Counted before the client can see them, so a scrape never lags a stream.
          if (metrics_) metrics_->add_tokens_generated(tokens_.size());
          write(&response_);
          return;
        case TokenOutbox::Item::kTurnEnd:
          if (write_failed_) continue;
          fill_turn_end(item.turn_end, &response_);
          write(&response_);
          return;
        case TokenOutbox::Item::kClosed:
          close(item.status, item.message);
          return;
      }
    }
  }

  // After a write completes: true the first time a write failed, when the caller must
  // cancel the sequence (the scheduler then frees its slot and closes the outbox).
  bool first_failure(bool ok) {
    if (ok || write_failed_) return false;
    write_failed_ = true;
    return true;
  }

 private:
  ServerMetrics* metrics_;  // may be null
  // Touched only by whoever holds the outbox's writer turn.
  Response response_;
  std::vector<int32_t> tokens_;
  std::unique_ptr<StreamDetokenizer> detokenizer_;
  std::string text_;
  bool write_failed_ = false;
};

}  // namespace m3
