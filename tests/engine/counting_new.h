// Counting replacements of the global operator new (every form, on every thread), for tests
// that assert a code path allocates nothing. Link counting_new.cc into the test's own
// executable (the replacements apply to the whole program).
#pragma once

namespace m3::testing {

void start_counting_allocations();
long stop_counting_allocations();  // allocations since start_counting_allocations()

// Counting only the allocations of threads that called mark_this_thread() (a fake
// engine marks the scheduler's engine thread from its step()), or of every thread.
void count_only_marked_threads(bool only);
void mark_this_thread();

}  // namespace m3::testing
