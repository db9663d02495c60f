// common/types: reductions for every dtype and op against a scalar reference,
// ScaleBuffer, and the float16 / bfloat16 conversions against an independent
// round-to-nearest-even oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/types.h"

namespace hvd {
namespace {

// ---------------------------------------------------------------------------
// Independent oracles for the 16-bit float formats (double arithmetic, ldexp).

// Value of a positive finite half bit pattern (0..0x7bff); 0x7c00 -> 2^16, the
// "next" value used only for rounding decisions at the top of the range.
double HalfMagnitude(int k) {
  int exp = k >> 10, mant = k & 0x3ff;
  if (exp == 0) return std::ldexp(mant, -24);
  return std::ldexp(1024 + mant, exp - 25);
}

double BFloat16Magnitude(int k) {  // 0..0x7f7f finite; 0x7f80 -> 2^128
  int exp = k >> 7, mant = k & 0x7f;
  if (exp == 0) return std::ldexp(mant, -133);
  return std::ldexp(128 + mant, exp - 134);
}

// Rounds |x| to the nearest representable value (ties to even) of a format whose
// positive finite bit patterns 0..max_bits are monotonic in value; beyond the
// largest finite value, rounding "up" to max_bits+1 means infinity.
uint16_t RoundOracle(double x, int max_bits, double (*mag)(int), uint16_t inf_bits,
                     uint16_t nan_bits, int sign_shift) {
  if (std::isnan(x)) return nan_bits;
  uint16_t sign = std::signbit(x) ? static_cast<uint16_t>(1u << sign_shift) : 0;
  double a = std::fabs(x);
  if (std::isinf(a)) return sign | inf_bits;
  // Largest k with mag(k) <= a.
  int lo = 0, hi = max_bits;
  if (a >= mag(max_bits)) {
    lo = max_bits;
  } else {
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (mag(mid) <= a)
        lo = mid;
      else
        hi = mid - 1;
    }
  }
  int k = lo;
  if (mag(k) == a) return sign | static_cast<uint16_t>(k);
  double below = a - mag(k), above = mag(k + 1) - a;
  int pick = below < above ? k : above < below ? k + 1 : (k % 2 == 0 ? k : k + 1);
  if (pick > max_bits) return sign | inf_bits;
  return sign | static_cast<uint16_t>(pick);
}

uint16_t RefFloatToHalf(double x) {
  return RoundOracle(x, 0x7bff, HalfMagnitude, 0x7c00, 0x7e00, 15);
}
uint16_t RefFloatToBFloat16(double x) {
  return RoundOracle(x, 0x7f7f, BFloat16Magnitude, 0x7f80, 0x7fc0, 15);
}

double RefHalfToDouble(uint16_t h) {
  double s = (h & 0x8000) ? -1.0 : 1.0;
  int k = h & 0x7fff;
  if ((k >> 10) == 0x1f)
    return (k & 0x3ff) ? std::numeric_limits<double>::quiet_NaN()
                       : s * std::numeric_limits<double>::infinity();
  return s * HalfMagnitude(k);
}

double RefBFloat16ToDouble(uint16_t b) {
  double s = (b & 0x8000) ? -1.0 : 1.0;
  int k = b & 0x7fff;
  if ((k >> 7) == 0xff)
    return (k & 0x7f) ? std::numeric_limits<double>::quiet_NaN()
                      : s * std::numeric_limits<double>::infinity();
  return s * BFloat16Magnitude(k);
}

bool IsHalfNaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool IsBf16NaN(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0; }

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------

TEST(Types, SizesNamesAndKinds) {
  EXPECT_EQ(DataTypeSize(DataType::kUInt8), 1u);
  EXPECT_EQ(DataTypeSize(DataType::kInt8), 1u);
  EXPECT_EQ(DataTypeSize(DataType::kBool), 1u);
  EXPECT_EQ(DataTypeSize(DataType::kInt16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kInt32), 4u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat32), 4u);
  EXPECT_EQ(DataTypeSize(DataType::kInt64), 8u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat64), 8u);
  EXPECT_STREQ(DataTypeName(DataType::kBFloat16), "bfloat16");
  EXPECT_STREQ(DataTypeName(DataType::kBool), "bool");
  EXPECT_STREQ(ReduceOpName(ReduceOp::kAverage), "Average");
  EXPECT_STREQ(ReduceOpName(ReduceOp::kProduct), "Product");
  EXPECT_EQ(kNumDataTypes, 10);  // the tables' rows
  EXPECT_EQ(kNumReduceOps, 6);
  // Numbering follows Horovod's Python constants.
  EXPECT_EQ(static_cast<int>(ReduceOp::kAverage), 0);
  EXPECT_EQ(static_cast<int>(ReduceOp::kSum), 1);
  EXPECT_EQ(static_cast<int>(ReduceOp::kAdasum), 2);
  EXPECT_EQ(static_cast<int>(ReduceOp::kMin), 3);
  EXPECT_EQ(static_cast<int>(ReduceOp::kMax), 4);
  EXPECT_EQ(static_cast<int>(ReduceOp::kProduct), 5);
}

const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};

// Integer reference: arithmetic in uint64 (well defined, wraps), truncated to T.
template <typename T>
T RefInt(T a, T b, ReduceOp op) {
  uint64_t ua = static_cast<uint64_t>(static_cast<int64_t>(a));
  uint64_t ub = static_cast<uint64_t>(static_cast<int64_t>(b));
  if (std::is_unsigned<T>::value) {
    ua = static_cast<uint64_t>(a);
    ub = static_cast<uint64_t>(b);
  }
  switch (op) {
    case ReduceOp::kSum:
      return static_cast<T>(ua + ub);
    case ReduceOp::kProduct:
      return static_cast<T>(ua * ub);
    case ReduceOp::kMin:
      return b < a ? b : a;
    case ReduceOp::kMax:
      return a < b ? b : a;
    default:
      return 0;
  }
}

template <typename T>
void CheckIntReduce(DataType dtype, int64_t lo, int64_t hi) {
  std::mt19937_64 rng(static_cast<uint64_t>(dtype) * 7919);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  const size_t n = 4099;
  for (ReduceOp op : kOps) {
    std::vector<T> a(n), b(n), expect(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<T>(dist(rng));
      b[i] = static_cast<T>(dist(rng));
      if (i < 4) {  // edge values
        a[i] = static_cast<T>(i % 2 ? lo : hi);
        b[i] = static_cast<T>(i / 2 ? lo : hi);
      }
      expect[i] = RefInt<T>(a[i], b[i], op);
    }
    std::vector<T> src = b;
    ReduceInto(a.data(), b.data(), n, dtype, op);
    EXPECT_EQ(a, expect) << DataTypeName(dtype) << " " << ReduceOpName(op);
    EXPECT_EQ(b, src) << "src modified";
  }
}

TEST(Types, ReduceIntegers) {
  // 8/16-bit types are promoted to int: full range, results wrap.
  CheckIntReduce<uint8_t>(DataType::kUInt8, 0, 255);
  CheckIntReduce<int8_t>(DataType::kInt8, -128, 127);
  CheckIntReduce<int16_t>(DataType::kInt16, -32768, 32767);
  // 32/64-bit: ranges where neither sum nor product overflows (signed overflow is UB).
  CheckIntReduce<int32_t>(DataType::kInt32, -30000, 30000);
  CheckIntReduce<int64_t>(DataType::kInt64, -(1LL << 31), 1LL << 31);
}

template <typename T>
void CheckFloatReduce(DataType dtype) {
  std::mt19937 rng(static_cast<unsigned>(dtype));
  std::uniform_real_distribution<double> dist(-100, 100);
  const size_t n = 1027;
  for (ReduceOp op : kOps) {
    std::vector<T> a(n), b(n), expect(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<T>(dist(rng));
      b[i] = (i % 7 == 0) ? a[i] : static_cast<T>(dist(rng));
      switch (op) {
        case ReduceOp::kSum:
          expect[i] = a[i] + b[i];
          break;
        case ReduceOp::kProduct:
          expect[i] = a[i] * b[i];
          break;
        case ReduceOp::kMin:
          expect[i] = b[i] < a[i] ? b[i] : a[i];
          break;
        case ReduceOp::kMax:
          expect[i] = a[i] < b[i] ? b[i] : a[i];
          break;
        default:
          break;
      }
    }
    ReduceInto(a.data(), b.data(), n, dtype, op);
    ASSERT_EQ(std::memcmp(a.data(), expect.data(), n * sizeof(T)), 0)
        << DataTypeName(dtype) << " " << ReduceOpName(op);
  }
}

TEST(Types, ReduceFloat32And64) {
  CheckFloatReduce<float>(DataType::kFloat32);
  CheckFloatReduce<double>(DataType::kFloat64);
}

// Half types: the exact result (in double) rounded once by the oracle. Computing
// in float and rounding again gives the same bits (float has >= 2p+2 bits).
void CheckHalfReduce(DataType dtype) {
  const bool is_half = dtype == DataType::kFloat16;
  std::mt19937 rng(99);
  const size_t n = 20000;
  auto random_finite = [&]() -> uint16_t {
    while (true) {
      uint16_t v = static_cast<uint16_t>(rng());
      if (is_half) {
        if ((v & 0x7c00) != 0x7c00) return v;
      } else {
        int exp = (v >> 7) & 0xff;  // keep products away from float over/underflow
        if (exp > 127 - 40 && exp < 127 + 40) return v;
      }
    }
  };
  for (ReduceOp op : kOps) {
    std::vector<uint16_t> a(n), b(n), expect(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = random_finite();
      b[i] = random_finite();
      if (i % 11 == 0) b[i] = a[i] ^ 0x8000;  // x + (-x)
      double x = is_half ? RefHalfToDouble(a[i]) : RefBFloat16ToDouble(a[i]);
      double y = is_half ? RefHalfToDouble(b[i]) : RefBFloat16ToDouble(b[i]);
      double r = 0;
      switch (op) {
        case ReduceOp::kSum:
          r = x + y;
          break;
        case ReduceOp::kProduct:
          r = x * y;
          break;
        case ReduceOp::kMin:
          r = y < x ? y : x;
          break;
        case ReduceOp::kMax:
          r = x < y ? y : x;
          break;
        default:
          break;
      }
      if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
        expect[i] = (r == x && std::signbit(r) == std::signbit(x)) ? a[i] : b[i];
      } else {
        expect[i] = is_half ? RefFloatToHalf(r) : RefFloatToBFloat16(r);
      }
    }
    std::vector<uint16_t> got = a;
    ReduceInto(got.data(), b.data(), n, dtype, op);
    int bad = 0;
    for (size_t i = 0; i < n && bad < 5; ++i) {
      if (got[i] != expect[i]) {
        ++bad;
        ADD_FAILURE() << DataTypeName(dtype) << " " << ReduceOpName(op) << std::hex << " a=0x"
                      << a[i] << " b=0x" << b[i] << " got=0x" << got[i] << " want=0x" << expect[i];
      }
    }
  }
}

TEST(Types, ReduceFloat16) { CheckHalfReduce(DataType::kFloat16); }
TEST(Types, ReduceBFloat16) { CheckHalfReduce(DataType::kBFloat16); }

TEST(Types, ReduceBoolIsOrAnd) {
  const uint8_t a0[] = {0, 0, 1, 1}, b[] = {0, 1, 0, 1};
  const uint8_t or_[] = {0, 1, 1, 1}, and_[] = {0, 0, 0, 1};
  for (ReduceOp op : kOps) {
    uint8_t a[4];
    std::memcpy(a, a0, 4);
    ReduceInto(a, b, 4, DataType::kBool, op);
    bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMax;
    EXPECT_EQ(std::memcmp(a, is_or ? or_ : and_, 4), 0) << ReduceOpName(op);
  }
  // Non-canonical true values (e.g. 2) still count as true and produce 1.
  uint8_t x[] = {2, 0, 7}, y[] = {0, 3, 9};
  ReduceInto(x, y, 3, DataType::kBool, ReduceOp::kMin);
  EXPECT_EQ(x[0], 0);
  EXPECT_EQ(x[1], 0);
  EXPECT_EQ(x[2], 1);
}

TEST(Types, ReduceZeroCountTouchesNothing) {
  float a = 1, b = 2;
  ReduceInto(&a, &b, 0, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(a, 1);
}

template <typename T>
void CheckScaleInt(DataType dtype, std::vector<T> in, double f, std::vector<T> want) {
  ScaleBuffer(in.data(), in.size(), dtype, f);
  EXPECT_EQ(in, want) << DataTypeName(dtype) << " * " << f;
}

TEST(Types, ScaleBufferIntegersTruncate) {
  CheckScaleInt<int32_t>(DataType::kInt32, {7, -7, 3, 0}, 0.5, {3, -3, 1, 0});
  CheckScaleInt<int64_t>(DataType::kInt64, {1LL << 40, -9}, 0.25, {1LL << 38, -2});
  CheckScaleInt<uint8_t>(DataType::kUInt8, {200, 10, 1}, 1.2, {240, 12, 1});
  CheckScaleInt<int8_t>(DataType::kInt8, {-100, 50}, 1.0 / 3, {-33, 16});
  CheckScaleInt<int16_t>(DataType::kInt16, {1000, -1000}, 3.0, {3000, -3000});
}

// Average is Sum with 1/size folded into the postscale; every other op keeps its
// factors. The factor is postscale * (1/size), bit for bit what every data plane
// computed before the fold was written once.
TEST(Types, FoldAverage) {
  FoldedReduction a = FoldAverage(ReduceOp::kAverage, 2.0, 0.5, 3);
  EXPECT_EQ(a.op, ReduceOp::kSum);
  EXPECT_EQ(a.pre, 2.0);
  EXPECT_EQ(a.post, 0.5 * (1.0 / 3));
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
    FoldedReduction f = FoldAverage(op, 3.0, 0.25, 4);
    EXPECT_EQ(f.op, op);
    EXPECT_EQ(f.pre, 3.0);
    EXPECT_EQ(f.post, 0.25);
  }
}

TEST(Types, ScaleBufferFloats) {
  std::vector<float> f = {1.0f, -3.0f, 0.1f, 1e30f};
  std::vector<float> fw;
  // computed in float with the factor rounded to float, as Horovod does (its tests
  // compare with tolerance 0 against factor.float() * tensor)
  for (float v : f) fw.push_back(v * static_cast<float>(0.1));
  ScaleBuffer(f.data(), f.size(), DataType::kFloat32, 0.1);
  EXPECT_EQ(std::memcmp(f.data(), fw.data(), 16), 0);

  std::vector<double> d = {1.0, -3.0, 0.1};
  ScaleBuffer(d.data(), d.size(), DataType::kFloat64, 0.1);
  EXPECT_EQ(d[0], 1.0 * 0.1);
  EXPECT_EQ(d[1], -3.0 * 0.1);
  EXPECT_EQ(d[2], 0.1 * 0.1);

  // float16: 1.5*2=3, -2*2=-4, 65504*2 overflows to inf, smallest subnormal/2 ties to 0.
  std::vector<uint16_t> h = {0x3e00, 0xc000, 0x7bff, 0x0001, 0x0003};
  ScaleBuffer(h.data(), h.size(), DataType::kFloat16, 2.0);
  EXPECT_EQ(h, (std::vector<uint16_t>{0x4200, 0xc400, 0x7c00, 0x0002, 0x0006}));
  ScaleBuffer(h.data(), h.size(), DataType::kFloat16, 0.25);
  // 3/4=0.75 (0x3a00), -1 (0xbc00), inf, 2^-23/4 = 2^-25 -> tie to 0, 6*2^-24/4 = 1.5*2^-24 -> 2
  EXPECT_EQ(h, (std::vector<uint16_t>{0x3a00, 0xbc00, 0x7c00, 0x0000, 0x0002}));

  std::vector<uint16_t> b = {0x3f80 /*1*/, 0xc040 /*-3*/};
  ScaleBuffer(b.data(), b.size(), DataType::kBFloat16, 0.5);
  EXPECT_EQ(b, (std::vector<uint16_t>{0x3f00, 0xbfc0}));
}

TEST(Types, ScaleByOneIsANoOp) {
  uint8_t flags[] = {0, 1, 5};  // bool cannot be scaled, but factor 1.0 returns early
  ScaleBuffer(flags, 3, DataType::kBool, 1.0);
  EXPECT_EQ(flags[2], 5);
  int32_t v[] = {std::numeric_limits<int32_t>::max()};
  ScaleBuffer(v, 1, DataType::kInt32, 1.0);
  EXPECT_EQ(v[0], std::numeric_limits<int32_t>::max());
}

// --- float16 ---------------------------------------------------------------

TEST(Float16, HalfToFloatMatchesDefinitionForAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    double want = RefHalfToDouble(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
      ASSERT_EQ(std::signbit(f), std::signbit(want)) << std::hex << h;
    }
  }
}

TEST(Float16, RoundTripAllNonNaNPatterns) {
  int checked = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t x = static_cast<uint16_t>(h);
    if (IsHalfNaN(x)) {
      ASSERT_TRUE(IsHalfNaN(FloatToHalf(HalfToFloat(x)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToHalf(HalfToFloat(x)), x) << std::hex << h;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);
}

TEST(Float16, HandPickedRounding) {
  struct Case {
    float in;
    uint16_t want;
    const char* what;
  };
  const float e11 = std::ldexp(1.0f, -11);
  const Case cases[] = {
      {1.0f, 0x3c00, "one"},
      {1.0f + e11, 0x3c00, "1+2^-11: tie between 1 and 1+2^-10 -> even (1.0)"},
      {1.0f + 3 * e11, 0x3c02, "1+3*2^-11: tie -> even (1+2^-9)"},
      {1.0f + e11 + std::ldexp(1.0f, -20), 0x3c01, "just above the tie rounds up"},
      {1.0f + e11 - std::ldexp(1.0f, -20), 0x3c00, "just below the tie rounds down"},
      {-(1.0f + 3 * e11), 0xbc02, "negative tie"},
      {2049.0f, 0x6800, "2049: tie between 2048 and 2050 -> 2048"},
      {2051.0f, 0x6802, "2051: tie -> 2052"},
      {65504.0f, 0x7bff, "max half"},
      {65519.0f, 0x7bff, "below the overflow tie"},
      {65520.0f, 0x7c00, "overflow tie rounds to inf"},
      {1e6f, 0x7c00, "overflow"},
      {-1e6f, 0xfc00, "negative overflow"},
      {std::numeric_limits<float>::infinity(), 0x7c00, "inf"},
      {-std::numeric_limits<float>::infinity(), 0xfc00, "-inf"},
      {std::numeric_limits<float>::max(), 0x7c00, "float max"},
      {0.0f, 0x0000, "zero"},
      {-0.0f, 0x8000, "negative zero"},
      {std::ldexp(1.0f, -14), 0x0400, "smallest normal"},
      {std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25), 0x0400,
       "tie between largest subnormal (odd) and smallest normal -> normal"},
      {std::ldexp(1.0f, -15), 0x0200, "subnormal 2^-15"},
      {std::ldexp(1.0f, -24), 0x0001, "smallest subnormal"},
      {std::ldexp(1.0f, -25), 0x0000, "half of smallest subnormal: tie -> 0"},
      {std::ldexp(1.5f, -25), 0x0001, "0.75 of smallest subnormal -> 1"},
      {std::ldexp(3.0f, -25), 0x0002, "1.5 * smallest subnormal: tie -> 2"},
      {std::ldexp(5.0f, -25), 0x0002, "2.5 * smallest subnormal: tie -> 2"},
      {-std::ldexp(1.0f, -25), 0x8000, "negative tiny -> -0"},
      {std::ldexp(1.0f, -26), 0x0000, "underflow"},
      {1e-30f, 0x0000, "deep underflow"},
      {std::numeric_limits<float>::denorm_min(), 0x0000, "float subnormal"},
      {0.1f, 0x2e66, "0.1"},
      {-2.5f, 0xc100, "-2.5"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToHalf(c.in), c.want) << c.what << std::hex << " got 0x" << FloatToHalf(c.in);
    EXPECT_EQ(RefFloatToHalf(c.in), c.want) << "oracle disagrees: " << c.what;
  }
  EXPECT_TRUE(IsHalfNaN(FloatToHalf(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsHalfNaN(FloatToHalf(FromBits(0x7f800001u))));  // signalling, low payload
  EXPECT_TRUE(IsHalfNaN(FloatToHalf(FromBits(0xffc00000u))));
}

// Every tie point between adjacent halves (and its float neighbours), plus many
// random floats of every exponent, against the oracle.
TEST(Float16, FloatToHalfMatchesOracle) {
  auto check = [](float f) {
    uint16_t got = FloatToHalf(f), want = RefFloatToHalf(f);
    if (std::isnan(f) ? !IsHalfNaN(got) : got != want) {
      ADD_FAILURE() << std::hexfloat << f << std::hex << " got 0x" << got << " want 0x" << want;
      return false;
    }
    return true;
  };
  for (int k = 0; k < 0x7c00; ++k) {
    float mid = static_cast<float>((HalfMagnitude(k) + HalfMagnitude(k + 1)) / 2);
    ASSERT_EQ(static_cast<double>(mid), (HalfMagnitude(k) + HalfMagnitude(k + 1)) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      if (!check(f) || !check(-f)) return;
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 300000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    // Bias half of the samples into the half range [2^-26, 2^17).
    if (i % 2) bits = (bits & 0x807fffffu) | ((101u + rng() % 43) << 23);
    if (!check(FromBits(bits))) return;
  }
}

// --- bfloat16 --------------------------------------------------------------

TEST(BFloat16, ToFloatIsTheUpperHalf) {
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    ASSERT_EQ(u, b << 16);
    double want = RefBFloat16ToDouble(static_cast<uint16_t>(b));
    if (!std::isnan(want)) {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << b;
    }
  }
}

TEST(BFloat16, RoundTripAllNonNaNPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t x = static_cast<uint16_t>(b);
    if (IsBf16NaN(x)) {
      ASSERT_TRUE(IsBf16NaN(FloatToBFloat16(BFloat16ToFloat(x)))) << std::hex << b;
    } else {
      ASSERT_EQ(FloatToBFloat16(BFloat16ToFloat(x)), x) << std::hex << b;
    }
  }
}

TEST(BFloat16, HandPickedRounding) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::denorm_min()), 0x0000);  // underflow
  EXPECT_TRUE(IsBf16NaN(FloatToBFloat16(FromBits(0x7f800001u))));  // payload only in low bits
  EXPECT_TRUE(IsBf16NaN(FloatToBFloat16(FromBits(0xff800001u))));
  EXPECT_TRUE(IsBf16NaN(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN())));
}

TEST(BFloat16, FloatToBFloat16MatchesOracle) {
  auto check = [](float f) {
    uint16_t got = FloatToBFloat16(f), want = RefFloatToBFloat16(f);
    if (got != want) {
      ADD_FAILURE() << std::hexfloat << f << std::hex << " got 0x" << got << " want 0x" << want;
      return false;
    }
    return true;
  };
  for (int k = 0; k < 0x7f80; ++k) {
    float mid = static_cast<float>((BFloat16Magnitude(k) + BFloat16Magnitude(k + 1)) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, std::numeric_limits<float>::infinity())}) {
      if (std::isinf(f)) continue;
      if (!check(f) || !check(-f)) return;
    }
  }
  std::mt19937 rng(8);
  for (int i = 0; i < 300000; ++i) {
    float f = FromBits(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    if (!check(f)) return;
  }
}

}  // namespace
}  // namespace hvd
