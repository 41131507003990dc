// StalledStreams: a closed stream's call is cancelled only after its writer made no
// progress for the whole stall time, never after the writer detached (its call done).
#include "server/stalled_streams.h"

#include <gtest/gtest.h>

namespace m3 {
namespace {

using std::chrono::seconds;

struct CountingWriter : StreamWriter {
  void flush() override {}
  void cancel_call() override { ++cancels; }
  int cancels = 0;
};

std::shared_ptr<Sequence> sequence(CountingWriter* writer) {
  return std::make_shared<Sequence>(SequenceParams{}, 4, writer);
}

TEST(StalledStreamsTest, CancelsOnlyAWriterThatMadeNoProgressForTheStallTime) {
  StalledStreams stalled;
  CountingWriter stuck_writer, reading_writer, done_writer;
  auto stuck = sequence(&stuck_writer), reading = sequence(&reading_writer), done = sequence(&done_writer);
  const Clock::time_point t0 = Clock::now();
  stalled.track(stuck, t0);
  stalled.track(reading, t0);
  stalled.track(done, t0);
  EXPECT_EQ(stalled.cut(t0 + seconds(5), seconds(10)), 0u);  // not yet
  reading->note_write_done();                                // its client reads
  done->detach_writer();                                     // its call ended
  EXPECT_EQ(stalled.cut(t0 + seconds(10), seconds(10)), 1u);
  EXPECT_EQ(stuck_writer.cancels, 1);
  EXPECT_EQ(reading_writer.cancels, 0);
  EXPECT_EQ(done_writer.cancels, 0);
  EXPECT_EQ(stalled.size(), 1u);  // the reading one, its progress seen at t0 + 10 s
  EXPECT_EQ(stalled.cut(t0 + seconds(19), seconds(10)), 0u);
  EXPECT_EQ(stalled.cut(t0 + seconds(20), seconds(10)), 1u);
  EXPECT_EQ(reading_writer.cancels, 1);
  EXPECT_EQ(stalled.size(), 0u);
}

}  // namespace
}  // namespace m3
