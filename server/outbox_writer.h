// The writer half shared by the stream reactors (Generate, Converse): turns what a
// Sequence's outbox holds into one response message at a time (tokens coalesced into one
// Tokens message, then a turn end), serialized for the reactor's StartWrite (the streams
// write bytes: wire_messages.h), and remembers a failed write (the call is gone):
// after that nothing more is written, but the outbox is still drained to its close.
// It counts the tokens it writes (m3serve_tokens_generated_total, and tokens_sent() for
// the stream's log line): tokens the outbox drops (a slow reader's, or at an error) never
// reach the client and are not counted.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/tokenizer.h"
#include "server/reply_segments.h"
#include "server/metrics.h"
#include "server/sequence.h"
#include "server/service_context.h"
#include "server/wire_messages.h"

namespace m3 {

template <class Response>
class OutboxWriter {
 public:
  explicit OutboxWriter(const ServiceContext& ctx) : metrics_(ctx.metrics) {
    if (ctx.tokenizer) detokenizer_ = std::make_unique<StreamDetokenizer>(*ctx.tokenizer);
    if (ctx.vocab) segmenter_ = std::make_unique<ReplySegmenter>(*ctx.vocab, ctx.tokenizer);
    tokens_.reserve(ctx.stream_buffer_tokens);
  }

  // Takes the outbox's next items until one makes a message, which goes to write(bytes)
  // (a gRPC write; its completion calls drain again), or the stream is closed, which goes
  // to close(status, message), or nothing is left (the flusher calls again when there is).
  // fill_turn_end(const TurnEnd&, Response*) writes a turn end into the response.
  template <class FillTurnEnd, class Write, class Close>
  void drain(Sequence& seq, FillTurnEnd&& fill_turn_end, Write&& write, Close&& close) {
    if (held_turn_end_) {  // its text went out in the previous message
      const TurnEnd end = *std::exchange(held_turn_end_, std::nullopt);
      if (!write_failed_) {
        fill_turn_end(end, &response_);
        write(wire(response_));
        return;
      }
    }
    for (;;) {
      TokenOutbox::Item item = seq.outbox().take(&tokens_);
      switch (item.kind) {
        case TokenOutbox::Item::kNothing:
          return;
        case TokenOutbox::Item::kTokens:
          if (write_failed_) continue;
          fill_tokens(tokens_, detokenizer_.get(), &text_, response_.mutable_tokens());
          if (segmenter_) {
            response_.mutable_tokens()->mutable_segments()->Clear();
            segmenter_->append(tokens_, response_.mutable_tokens()->mutable_segments());
          }
          // Counted before the client can see them, so a scrape never lags a stream.
          if (metrics_) metrics_->add_tokens_generated(tokens_.size());
          tokens_sent_.fetch_add(tokens_.size(), std::memory_order_relaxed);
          write(wire(response_));
          return;
        case TokenOutbox::Item::kTurnEnd:
          if (write_failed_) continue;
          // A character the turn's last byte pieces left incomplete ends the turn's text
          // (as U+FFFD) in a message of its own, rather than being lost or starting the
          // next turn's text; the turn end follows.
          if (flush_held_text()) {
            held_turn_end_ = item.turn_end;
            write(wire(response_));
            return;
          }
          fill_turn_end(item.turn_end, &response_);
          write(wire(response_));
          return;
        case TokenOutbox::Item::kSnapshotSaved:
          if (write_failed_) continue;
          if constexpr (requires(Response r) { r.mutable_snapshot_saved(); }) {
            response_.mutable_snapshot_saved()->set_snapshot_id(item.snapshot_id);
            write(wire(response_));
            return;
          }
          continue;
        case TokenOutbox::Item::kClosed:
          close(item.status, item.message);
          return;
      }
    }
  }

  // Tokens written to the stream so far (what the metric counted for it).
  uint64_t tokens_sent() const { return tokens_sent_.load(std::memory_order_relaxed); }

  // After a write completes: true the first time a write failed, when the caller must
  // cancel the sequence (the scheduler then frees its slot and closes the outbox).
  bool first_failure(bool ok) {
    if (ok || write_failed_) return false;
    write_failed_ = true;
    return true;
  }

 private:
  // The message as the bytes of the next write (kept until it completes).
  const grpc::ByteBuffer* wire(const Response& response) {
    serialize_message(response, &wire_);
    return &wire_;
  }

  // Puts the detokenizer's held-back text, if any, and the segments still waiting (an
  // unfinished character, a broken-off frame) into response_ as a Tokens message with no
  // ids; false when there is none.
  bool flush_held_text() {
    auto* tokens = response_.mutable_tokens();
    tokens->mutable_ids()->Clear();
    tokens->mutable_segments()->Clear();
    text_.clear();
    if (detokenizer_) detokenizer_->finish(&text_);
    tokens->set_text(text_);
    if (segmenter_) segmenter_->finish(tokens->mutable_segments());
    return !text_.empty() || !tokens->segments().empty();
  }

  ServerMetrics* metrics_;  // may be null
  // Touched only by whoever holds the outbox's writer turn.
  Response response_;
  grpc::ByteBuffer wire_;
  std::vector<int32_t> tokens_;
  std::unique_ptr<StreamDetokenizer> detokenizer_;
  std::unique_ptr<ReplySegmenter> segmenter_;  // with a vocabulary layout
  std::string text_;
  std::optional<TurnEnd> held_turn_end_;  // to write after the held text (see drain)
  bool write_failed_ = false;
  // Read at the call's end, on the reactor's thread rather than the writer turn's.
  std::atomic<uint64_t> tokens_sent_{0};
};

}  // namespace m3
