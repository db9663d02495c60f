// Waiters: the count of callers waiting for their ops, which ends the runtime's
// hold on fresh GPU allreduces (docs/design.md §8).
#include "core/waiters.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace hvd {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(Waiters, ScopeCountsTheWaitingThread) {
  Waiters w;
  EXPECT_FALSE(w.Any());
  {
    Waiters::Scope a(&w);
    Waiters::Scope b(&w);
    EXPECT_TRUE(w.Any());
  }
  EXPECT_FALSE(w.Any());
  Waiters::Scope none(nullptr);  // handles without a runtime count nothing
  EXPECT_FALSE(w.Any());
}

TEST(Waiters, NapSleepsItsPeriodWhenNobodyWaits) {
  Waiters w;
  auto t0 = steady_clock::now();
  EXPECT_FALSE(w.Nap(std::chrono::microseconds(20000)));
  EXPECT_GE(steady_clock::now() - t0, milliseconds(20));
}

TEST(Waiters, ACallerStartingToWaitEndsTheNap) {
  Waiters w;
  std::thread caller([&] {
    std::this_thread::sleep_for(milliseconds(50));
    Waiters::Scope waiting(&w);
    std::this_thread::sleep_for(milliseconds(200));
  });
  auto t0 = steady_clock::now();
  EXPECT_TRUE(w.Nap(std::chrono::microseconds(20 * 1000 * 1000)));  // 20 s if never woken
  EXPECT_LT(steady_clock::now() - t0, std::chrono::seconds(10));
  caller.join();
  EXPECT_FALSE(w.Any());
}

}  // namespace
}  // namespace hvd
