// core/response_cache: put / lookup / signature mismatch, LRU eviction, erase,
// capacity 0, bit helpers, and a randomized comparison with a reference LRU.
#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <random>

#include "core/response_cache.h"

namespace hvd {
namespace {

Response Resp(const std::string& name, int64_t dim = 1) {
  Response r;
  r.name = name;
  r.shape = {dim};
  return r;
}

TEST(ResponseCache, PutLookupGet) {
  ResponseCache c(4);
  EXPECT_EQ(c.capacity(), 4u);
  EXPECT_EQ(c.num_words(), 1u);
  int ev = 123;
  int pa = c.Put(Resp("a", 1), "sigA", &ev);
  EXPECT_EQ(ev, -1);
  int pb = c.Put(Resp("b", 2), "sigB", &ev);
  EXPECT_EQ(ev, -1);
  EXPECT_GE(pa, 0);
  EXPECT_LT(pa, 4);
  EXPECT_GE(pb, 0);
  EXPECT_LT(pb, 4);
  EXPECT_NE(pa, pb);
  EXPECT_EQ(c.size(), 2u);

  bool same = false;
  EXPECT_EQ(c.Lookup("a", "sigA", &same), pa);
  EXPECT_TRUE(same);
  same = true;
  EXPECT_EQ(c.Lookup("a", "sigB", &same), pa);  // found, but a different request
  EXPECT_FALSE(same);
  EXPECT_EQ(c.Lookup("zzz", "sigA", &same), -1);
  EXPECT_EQ(c.Get(pb).name, "b");
  EXPECT_EQ(c.Get(pb).shape, std::vector<int64_t>{2});
}

TEST(ResponseCache, PositionsAreDeterministic) {
  // Every rank must assign the same positions given the same sequence of calls.
  ResponseCache a(5), b(5);
  int ev1, ev2;
  for (int i = 0; i < 20; ++i) {
    std::string name = "t" + std::to_string(i * 7 % 9);
    if (i % 3 == 0) {
      bool s;
      int p1 = a.Lookup(name, "", &s), p2 = b.Lookup(name, "x", &s);
      EXPECT_EQ(p1, p2);
      if (p1 >= 0) {
        a.Touch(p1);
        b.Touch(p2);
      }
    }
    EXPECT_EQ(a.Put(Resp(name), "sig-a", &ev1), b.Put(Resp(name), "sig-b", &ev2));
    EXPECT_EQ(ev1, ev2);
  }
}

TEST(ResponseCache, LruEvictionReturnsEvictedPosition) {
  ResponseCache c(3);
  int ev;
  int pa = c.Put(Resp("a"), "", &ev);
  int pb = c.Put(Resp("b"), "", &ev);
  int pc = c.Put(Resp("c"), "", &ev);
  ASSERT_EQ(ev, -1);
  c.Touch(pa);  // LRU order now b, c, a
  int pd = c.Put(Resp("d"), "", &ev);
  EXPECT_EQ(ev, pb);
  EXPECT_EQ(pd, pb);  // d takes over b's position
  bool same;
  EXPECT_EQ(c.Lookup("b", "", &same), -1);
  EXPECT_EQ(c.Lookup("d", "", &same), pd);
  EXPECT_EQ(c.Get(pd).name, "d");
  EXPECT_EQ(c.size(), 3u);
  // Next victim: c (a was touched, d is newest).
  int pe = c.Put(Resp("e"), "", &ev);
  EXPECT_EQ(ev, pc);
  EXPECT_EQ(pe, pc);
  // Then a.
  c.Put(Resp("f"), "", &ev);
  EXPECT_EQ(ev, pa);
  EXPECT_EQ(c.Lookup("a", "", &same), -1);
}

TEST(ResponseCache, PutSameNameReplacesWithoutEviction) {
  ResponseCache c(2);
  int ev;
  int pa = c.Put(Resp("a", 1), "s1", &ev);
  c.Put(Resp("b", 1), "s1", &ev);
  int pa2 = c.Put(Resp("a", 5), "s2", &ev);
  EXPECT_EQ(ev, -1) << "replacing an entry must not evict another";
  EXPECT_EQ(pa2, pa);
  EXPECT_EQ(c.size(), 2u);
  bool same;
  EXPECT_EQ(c.Lookup("a", "s2", &same), pa);
  EXPECT_TRUE(same);
  EXPECT_EQ(c.Get(pa).shape, std::vector<int64_t>{5});
  EXPECT_GE(c.Lookup("b", "s1", &same), 0);
}

TEST(ResponseCache, EraseFreesAPosition) {
  ResponseCache c(2);
  int ev;
  int pa = c.Put(Resp("a"), "", &ev);
  int pb = c.Put(Resp("b"), "", &ev);
  c.Erase(pa);
  EXPECT_EQ(c.size(), 1u);
  bool same;
  EXPECT_EQ(c.Lookup("a", "", &same), -1);
  c.Erase(pa);  // erasing a free position is a no-op
  EXPECT_EQ(c.size(), 1u);
  int pc = c.Put(Resp("c"), "", &ev);
  EXPECT_EQ(ev, -1) << "a free position exists, nothing should be evicted";
  EXPECT_EQ(pc, pa);
  EXPECT_EQ(c.Lookup("b", "", &same), pb);
  // Cache is full again: the next put evicts the LRU (b).
  c.Put(Resp("d"), "", &ev);
  EXPECT_EQ(ev, pb);
}

TEST(ResponseCache, CapacityZeroCachesNothing) {
  ResponseCache c(0);
  EXPECT_EQ(c.num_words(), 0u);
  int ev = 7;
  EXPECT_EQ(c.Put(Resp("a"), "", &ev), -1);
  EXPECT_EQ(ev, -1);
  EXPECT_EQ(c.size(), 0u);
  bool same;
  EXPECT_EQ(c.Lookup("a", "", &same), -1);
}

TEST(ResponseCache, NumWords) {
  EXPECT_EQ(ResponseCache(1).num_words(), 1u);
  EXPECT_EQ(ResponseCache(64).num_words(), 1u);
  EXPECT_EQ(ResponseCache(65).num_words(), 2u);
  EXPECT_EQ(ResponseCache(1024).num_words(), 16u);
}

TEST(ResponseCache, BitHelpers) {
  std::vector<uint64_t> bits(2, 0);
  SetBit(&bits, 0);
  SetBit(&bits, 63);
  SetBit(&bits, 64);
  SetBit(&bits, 127);
  EXPECT_EQ(bits[0], 0x8000000000000001ull);
  EXPECT_EQ(bits[1], 0x8000000000000001ull);
  EXPECT_TRUE(TestBit(bits, 0));
  EXPECT_FALSE(TestBit(bits, 1));
  EXPECT_TRUE(TestBit(bits, 127));
  EXPECT_FALSE(TestBit(bits, 128));  // beyond the vector: false, no crash
  EXPECT_FALSE(TestBit({}, 0));
}

// Random operations against a reference model of an LRU with position reuse.
TEST(ResponseCache, MatchesReferenceLru) {
  const int cap = 6;
  ResponseCache c(cap);
  std::list<std::string> lru;  // front = least recently used
  std::map<std::string, int> pos;
  std::mt19937 rng(5);
  for (int step = 0; step < 5000; ++step) {
    std::string name = "n" + std::to_string(rng() % 10);
    int action = rng() % 3;
    bool same;
    int p = c.Lookup(name, "sig", &same);
    ASSERT_EQ(p, pos.count(name) ? pos[name] : -1) << "step " << step;
    if (action == 0 && p >= 0) {
      c.Touch(p);
      lru.remove(name);
      lru.push_back(name);
    } else if (action == 1 && p >= 0) {
      c.Erase(p);
      lru.remove(name);
      pos.erase(name);
    } else {
      int ev;
      int np = c.Put(Resp(name), "sig", &ev);
      if (pos.count(name)) {
        ASSERT_EQ(ev, -1);
        lru.remove(name);
        pos.erase(name);
      } else if (static_cast<int>(pos.size()) == cap) {
        std::string victim = lru.front();
        lru.pop_front();
        ASSERT_EQ(ev, pos[victim]) << "step " << step;
        ASSERT_EQ(np, pos[victim]);
        pos.erase(victim);
      } else {
        ASSERT_EQ(ev, -1);
      }
      for (auto& kv : pos) ASSERT_NE(kv.second, np) << "position handed out twice";
      pos[name] = np;
      lru.push_back(name);
    }
    ASSERT_EQ(c.size(), pos.size());
    for (auto& kv : pos) ASSERT_EQ(c.Get(kv.second).name, kv.first);
  }
}

}  // namespace
}  // namespace hvd
