// redis://HOST:PORT — snapshots as Redis strings (key "m3serve:snapshot:ID"), so replicas
// pointing at the same Redis share them. One connection, made on first use and again
// after a failure; every call has a 2 s timeout, so an unreachable Redis costs a request
// an UNAVAILABLE, never a stuck thread; for 1 s after a failure calls fail at once, so
// that requests queued behind a hung Redis do not each wait out the timeout.
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <chrono>
#include <mutex>

#include "server/snapshot_store.h"

namespace m3 {
namespace {

constexpr timeval kTimeout{2, 0};
constexpr std::chrono::seconds kRetryAfter{1};

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;
struct ContextDeleter {
  void operator()(redisContext* c) const { redisFree(c); }
};

class RedisBackend final : public SnapshotBackend {
 public:
  RedisBackend(std::string host, int port) : host_(std::move(host)), port_(port) {}
  std::string describe() const override { return "redis://" + host_ + ":" + std::to_string(port_); }

  void put(const std::string& id, std::span<const std::byte> bytes, std::chrono::milliseconds ttl) override {
    const std::string key = key_of(id);
    Reply r = ttl.count() > 0
                  ? command("SET", "SET %b %b PX %lld", key.data(), key.size(), bytes.data(), bytes.size(),
                            static_cast<long long>(ttl.count()))
                  : command("SET", "SET %b %b", key.data(), key.size(), bytes.data(), bytes.size());
    if (r->type != REDIS_REPLY_STATUS) throw refused("SET", r.get());
  }
  std::optional<std::vector<std::byte>> get(const std::string& id) override {
    const std::string key = key_of(id);
    Reply r = command("GET", "GET %b", key.data(), key.size());
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    if (r->type != REDIS_REPLY_STRING) throw refused("GET", r.get());
    const auto* p = reinterpret_cast<const std::byte*>(r->str);
    return std::vector<std::byte>(p, p + r->len);
  }
  bool remove(const std::string& id) override {
    const std::string key = key_of(id);
    Reply r = command("DEL", "DEL %b", key.data(), key.size());
    if (r->type != REDIS_REPLY_INTEGER) throw refused("DEL", r.get());
    return r->integer > 0;
  }

 private:
  static std::string key_of(const std::string& id) { return "m3serve:snapshot:" + id; }

  SnapshotStoreError unavailable(const std::string& why) const {
    return SnapshotStoreError(SnapshotStoreError::Kind::kUnavailable,
                              "snapshot store " + describe() + " is unreachable: " + why);
  }
  SnapshotStoreError refused(const char* op, const redisReply* r) const {
    const std::string said = r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "an unexpected reply";
    return SnapshotStoreError(SnapshotStoreError::Kind::kUnavailable,
                              "snapshot store " + describe() + " refused " + op + ": " + said);
  }

  template <typename... Args>
  Reply command(const char* op, const char* format, Args... args) {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now < retry_at_) {
      throw unavailable(last_failure_ + " (not tried again until " + std::to_string(kRetryAfter.count()) +
                        " s after a failure)");
    }
    if (!ctx_) {
      ctx_.reset(redisConnectWithTimeout(host_.c_str(), port_, kTimeout));
      if (!ctx_) throw unavailable("out of memory for a connection");
      if (ctx_->err) {
        const std::string why = ctx_->errstr;
        ctx_.reset();
        throw failed(why);
      }
      redisSetTimeout(ctx_.get(), kTimeout);
    }
    Reply r(static_cast<redisReply*>(redisCommand(ctx_.get(), format, args...)));
    if (!r) {
      const std::string why = std::string(op) + ": " + (ctx_->err ? ctx_->errstr : "no reply");
      ctx_.reset();  // the next call connects again
      throw failed(why);
    }
    return r;
  }
  // The error for a failure just seen, which the calls of the next kRetryAfter repeat (mu_ held).
  SnapshotStoreError failed(const std::string& why) {
    last_failure_ = why;
    retry_at_ = std::chrono::steady_clock::now() + kRetryAfter;
    return unavailable(why);
  }

  const std::string host_;
  const int port_;
  std::mutex mu_;
  std::unique_ptr<redisContext, ContextDeleter> ctx_;
  std::chrono::steady_clock::time_point retry_at_;  // calls before it fail at once
  std::string last_failure_;
};

}  // namespace

std::unique_ptr<SnapshotBackend> make_redis_snapshot_backend(const std::string& host, int port) {
  return std::make_unique<RedisBackend>(host, port);
}

}  // namespace m3
