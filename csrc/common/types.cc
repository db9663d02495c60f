#include "common/types.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace hvd {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
#define HVD_SIZE_ROW(name, value, text, bytes, torch) \
  case DataType::name:                                \
    return bytes;
    HVD_DATA_TYPES(HVD_SIZE_ROW)
#undef HVD_SIZE_ROW
  }
  HVD_CHECK(false && "unknown DataType");
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
#define HVD_NAME_ROW(name, value, text, bytes, torch) \
  case DataType::name:                                \
    return text;
    HVD_DATA_TYPES(HVD_NAME_ROW)
#undef HVD_NAME_ROW
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
#define HVD_NAME_ROW(name, value, text) \
  case ReduceOp::name:                  \
    return text;
    HVD_REDUCE_OPS(HVD_NAME_ROW)
#undef HVD_NAME_ROW
  }
  return "unknown";
}

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = absx >> 23;
    uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 113 - e + 13
    uint32_t half_m = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t h = ((absx >> 13) - ((127 - 15) << 10));
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

namespace {

template <typename T>
void ReduceTyped(T* dst, const T* src, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(dst[i] + src[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) dst[i] = std::min(dst[i], src[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
      return;
    case ReduceOp::kProduct:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(dst[i] * src[i]);
      return;
    default:
      HVD_CHECK(false && "ReduceInto supports Sum, Min, Max, Product");
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void ReduceHalf(uint16_t* dst, const uint16_t* src, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    float a = ToF(dst[i]), b = ToF(src[i]);
    float r;
    switch (op) {
      case ReduceOp::kSum:
        r = a + b;
        break;
      case ReduceOp::kMin:
        r = std::min(a, b);
        break;
      case ReduceOp::kMax:
        r = std::max(a, b);
        break;
      case ReduceOp::kProduct:
        r = a * b;
        break;
      default:
        HVD_CHECK(false && "ReduceInto supports Sum, Min, Max, Product");
        return;
    }
    dst[i] = FromF(r);
  }
}

void ReduceBool(uint8_t* dst, const uint8_t* src, size_t n, ReduceOp op) {
  bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMax;
  for (size_t i = 0; i < n; ++i) {
    dst[i] = is_or ? (dst[i] || src[i]) : (dst[i] && src[i]);
  }
}

template <typename T>
void ScaleTyped(T* buf, size_t n, double factor) {
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<T>(buf[i] * factor);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void ScaleHalf(uint16_t* buf, size_t n, double factor) {
  float f = static_cast<float>(factor);
  for (size_t i = 0; i < n; ++i) buf[i] = FromF(ToF(buf[i]) * f);
}

}  // namespace

void ReduceInto(void* dst, const void* src, size_t n, DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kUInt8:
      return ReduceTyped(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
    case DataType::kInt8:
      return ReduceTyped(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n, op);
    case DataType::kInt16:
      return ReduceTyped(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), n, op);
    case DataType::kInt32:
      return ReduceTyped(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n, op);
    case DataType::kInt64:
      return ReduceTyped(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
    case DataType::kFloat32:
      return ReduceTyped(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DataType::kFloat64:
      return ReduceTyped(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DataType::kFloat16:
      return ReduceHalf<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(dst),
                                                  static_cast<const uint16_t*>(src), n, op);
    case DataType::kBFloat16:
      return ReduceHalf<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(dst),
                                                          static_cast<const uint16_t*>(src), n, op);
    case DataType::kBool:
      return ReduceBool(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n, op);
  }
}

FoldedReduction FoldAverage(ReduceOp op, double prescale, double postscale, int size) {
  if (op != ReduceOp::kAverage) return FoldedReduction{op, prescale, postscale};
  return FoldedReduction{ReduceOp::kSum, prescale, postscale * (1.0 / size)};
}

void ScaleBuffer(void* buf, size_t n, DataType dtype, double factor) {
  if (factor == 1.0) return;
  switch (dtype) {
    case DataType::kUInt8:
      return ScaleTyped(static_cast<uint8_t*>(buf), n, factor);
    case DataType::kInt8:
      return ScaleTyped(static_cast<int8_t*>(buf), n, factor);
    case DataType::kInt16:
      return ScaleTyped(static_cast<int16_t*>(buf), n, factor);
    case DataType::kInt32:
      return ScaleTyped(static_cast<int32_t*>(buf), n, factor);
    case DataType::kInt64:
      return ScaleTyped(static_cast<int64_t*>(buf), n, factor);
    case DataType::kFloat32: {
      float* p = static_cast<float*>(buf);
      float f = static_cast<float>(factor);
      for (size_t i = 0; i < n; ++i) p[i] *= f;
      return;
    }
    case DataType::kFloat64:
      return ScaleTyped(static_cast<double*>(buf), n, factor);
    case DataType::kFloat16:
      return ScaleHalf<HalfToFloat, FloatToHalf>(static_cast<uint16_t*>(buf), n, factor);
    case DataType::kBFloat16:
      return ScaleHalf<BFloat16ToFloat, FloatToBFloat16>(static_cast<uint16_t*>(buf), n, factor);
    case DataType::kBool:
      HVD_CHECK(false && "cannot scale a bool buffer");
  }
}

}  // namespace hvd
