// Byte-level encoding used by every message on the wire: fixed-width integers and
// doubles copied in host byte order (every supported host is little-endian),
// booleans as one byte 0 or 1, strings and vectors length-prefixed (u32).
// Reader never reads past the end, and never allocates more than what is left of
// its buffer: a short or corrupt buffer (a length beyond the end, a boolean byte
// other than 0 or 1) sets ok() to false. Every value has one encoding, so a
// buffer a decoder accepts re-encodes to the same bytes (tests/cpp/fuzz_test.cc).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace hvd {

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void Bool(bool v) { U8(v ? 1 : 0); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void I32(int32_t v) { Raw(&v, 4); }
  void I64(int64_t v) { Raw(&v, 8); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void F64(double v) { Raw(&v, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void I64s(const std::vector<int64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) I64(x);
  }
  void U64s(const std::vector<uint64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (uint64_t x : v) U64(x);
  }
  std::string& str() { return out_; }

 private:
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), end_(data + size) {}
  explicit Reader(const std::string& s) : Reader(s.data(), s.size()) {}

  uint8_t U8() {
    uint8_t v = 0;
    Raw(&v, 1);
    return v;
  }
  bool Bool() {
    const uint8_t v = U8();
    if (v > 1) ok_ = false;
    return v == 1;
  }
  uint32_t U32() { return Get<uint32_t>(); }
  int32_t I32() { return Get<int32_t>(); }
  int64_t I64() { return Get<int64_t>(); }
  uint64_t U64() { return Get<uint64_t>(); }
  double F64() { return Get<double>(); }
  std::string Str() {
    uint32_t n = U32();
    if (!ok_ || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return {};
    }
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> I64s() { return Vec<int64_t>(); }
  std::vector<uint64_t> U64s() { return Vec<uint64_t>(); }

  bool ok() const { return ok_; }
  bool done() const { return p_ == end_; }

 private:
  template <typename T>
  T Get() {
    T v{};
    Raw(&v, sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> Vec() {
    uint32_t n = U32();
    if (!ok_ || static_cast<size_t>(end_ - p_) / sizeof(T) < n) {
      ok_ = false;
      return {};
    }
    std::vector<T> v(n);
    Raw(v.data(), n * sizeof(T));
    return v;
  }
  void Raw(void* dst, size_t n) {
    if (!ok_ || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return;
    }
    if (n == 0) return;
    std::memcpy(dst, p_, n);
    p_ += n;
  }
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

}  // namespace hvd
