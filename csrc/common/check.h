// HVD_CHECK: a broken invariant is a bug, not a recoverable error. It names the
// file, line and condition and aborts the process.
#pragma once

#include <cstdio>
#include <cstdlib>

#define HVD_CHECK(cond)                                                                      \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "horovod_torch: CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, \
                   #cond);                                                                   \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)
