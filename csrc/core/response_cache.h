// The response cache: after a tensor name has been negotiated once, every rank
// remembers its Response at the same bit position (ranks insert and evict in the
// same order, because they process the same response lists). In the steady state
// a rank announces a pending repeat by setting that bit, the coordinator ANDs the
// bit vectors, and no request text crosses the wire.
//
// A rank whose new request differs from the cached one (shape, dtype, ...) sets
// the position's invalid bit; the OR of invalid bits makes every rank evict it and
// re-send the pending request in full.
//
// Threading: used only by the background thread. Torch-free.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "wire/message.h"

namespace hvd {

class ResponseCache {
 public:
  explicit ResponseCache(size_t capacity);

  size_t capacity() const { return capacity_; }
  size_t num_words() const { return (capacity_ + 63) / 64; }

  // Position of `name` or -1. *same tells whether the cached request signature
  // equals `signature`.
  int Lookup(const std::string& name, const std::string& signature, bool* same) const;
  const Response& Get(int pos) const;
  // Marks pos as most recently used.
  void Touch(int pos);
  // Inserts the response for response.name (replacing any entry of that name) and
  // returns its position; if the cache was full, *evicted gets the position it
  // took over (else -1). `signature` is this rank's request signature.
  int Put(const Response& response, const std::string& signature, int* evicted);
  void Erase(int pos);
  size_t size() const { return by_name_.size(); }

 private:
  struct Entry {
    Response response;
    std::string signature;
    bool used = false;
    std::list<int>::iterator lru_it;
  };
  size_t capacity_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int> by_name_;
  std::list<int> lru_;  // front = least recently used
  std::vector<int> free_;
};

// Bit-vector helpers.
void SetBit(std::vector<uint64_t>* bits, size_t pos);
bool TestBit(const std::vector<uint64_t>& bits, size_t pos);

}  // namespace hvd
