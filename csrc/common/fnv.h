// FNV-1a, 64 bits: a cheap hash that every rank computes alike (not for security).
// The keys the ranks must agree on without sending them whole use it: a group of ops'
// id (python/bindings.cc), a response's devices (wire/message.cc), a shared-memory
// step's layout (transport/shm_collectives.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace hvd {

class Fnv1a {
 public:
  Fnv1a& Byte(uint8_t b) {
    h_ = (h_ ^ b) * 1099511628211ULL;
    return *this;
  }
  Fnv1a& Bytes(const std::string& s) {
    for (unsigned char c : s) Byte(c);
    return *this;
  }
  // An integer's bytes, least significant first (the same on every host).
  template <typename T>
  Fnv1a& Int(T v) {
    static_assert(std::is_integral<T>::value, "Fnv1a::Int takes integers");
    using U = typename std::make_unsigned<T>::type;
    const U u = static_cast<U>(v);
    for (size_t b = 0; b < sizeof(T); ++b) Byte(static_cast<uint8_t>(u >> (8 * b)));
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ULL;
};

}  // namespace hvd
