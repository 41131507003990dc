// Counting replacements of the global operator new (every form, on every thread), for tests
// that assert a code path allocates nothing. Link counting_new.cc into the test's own
// executable (the replacements apply to the whole program).
#pragma once

namespace m3::testing {

void start_counting_allocations();
long stop_counting_allocations();  // allocations since start_counting_allocations()

}  // namespace m3::testing
