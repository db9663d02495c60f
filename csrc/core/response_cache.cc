#include "core/response_cache.h"

#include "common/check.h"

namespace hvd {

ResponseCache::ResponseCache(size_t capacity) : capacity_(capacity), entries_(capacity) {
  for (size_t i = capacity; i > 0; --i) free_.push_back(static_cast<int>(i - 1));
}

int ResponseCache::Lookup(const std::string& name, const std::string& signature, bool* same) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return -1;
  *same = entries_[it->second].signature == signature;
  return it->second;
}

const Response& ResponseCache::Get(int pos) const {
  HVD_CHECK(pos >= 0 && static_cast<size_t>(pos) < capacity_ && entries_[pos].used);
  return entries_[pos].response;
}

void ResponseCache::Touch(int pos) {
  Entry& e = entries_[pos];
  HVD_CHECK(e.used);
  lru_.erase(e.lru_it);
  e.lru_it = lru_.insert(lru_.end(), pos);
}

int ResponseCache::Put(const Response& response, const std::string& signature, int* evicted) {
  *evicted = -1;
  if (capacity_ == 0) return -1;
  auto existing = by_name_.find(response.name);
  if (existing != by_name_.end()) Erase(existing->second);
  int pos;
  if (!free_.empty()) {
    pos = free_.back();
    free_.pop_back();
  } else {
    pos = lru_.front();
    Erase(pos);
    free_.pop_back();  // Erase returned pos to the free list; take it again
    *evicted = pos;
  }
  Entry& e = entries_[pos];
  e.response = response;
  e.signature = signature;
  e.used = true;
  e.lru_it = lru_.insert(lru_.end(), pos);
  by_name_[response.name] = pos;
  return pos;
}

void ResponseCache::Erase(int pos) {
  Entry& e = entries_[pos];
  if (!e.used) return;
  by_name_.erase(e.response.name);
  lru_.erase(e.lru_it);
  e.used = false;
  e.response = Response();
  e.signature.clear();
  free_.push_back(pos);
}

void SetBit(std::vector<uint64_t>* bits, size_t pos) { (*bits)[pos / 64] |= 1ull << (pos % 64); }

bool TestBit(const std::vector<uint64_t>& bits, size_t pos) {
  return pos / 64 < bits.size() && ((bits[pos / 64] >> (pos % 64)) & 1);
}

}  // namespace hvd
