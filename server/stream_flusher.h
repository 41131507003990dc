// A thread that starts writes on idle streams, so the engine thread never serialises
// a message or calls into gRPC: after each step it hands over the streams whose writer
// was idle, and this thread calls their flush(). Writes that complete start the next
// one themselves (on gRPC's callback threads).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/sequence.h"

namespace m3 {

class StreamFlusher {
 public:
  // `expected_streams` sizes the hand-over buffers (no allocation while within it).
  explicit StreamFlusher(size_t expected_streams);
  ~StreamFlusher();  // flushes what is queued, then stops

  void wake(std::shared_ptr<Sequence> sequence);
  void wake_all(std::vector<std::shared_ptr<Sequence>>* sequences);  // empties *sequences

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Sequence>> queued_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace m3
