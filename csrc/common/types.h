// Element types and reduction operations shared by every layer. Raw buffers only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hvd {

enum class DataType : uint8_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBool = 9,
};

// Numbering follows Horovod's Python constants (hvd.Average == 0, hvd.Sum == 1, ...).
enum class ReduceOp : uint8_t {
  kAverage = 0,
  kSum = 1,
  kAdasum = 2,
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);

// dst[i] = dst[i] <op> src[i] for `count` elements. `op` must be Sum, Min, Max or
// Product (Average is Sum followed by a scale). Bool: Sum/Max are OR, Min/Product AND.
void ReduceInto(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// buf[i] *= factor, computed in double (float for half types) and cast back.
void ScaleBuffer(void* buf, size_t count, DataType dtype, double factor);

// A reduction as every data plane runs it: Average is a Sum whose 1/size joins the
// postscale. `pre` multiplies each rank's input, `post` the reduced result.
struct FoldedReduction {
  ReduceOp op;
  double pre;
  double post;
};
FoldedReduction FoldAverage(ReduceOp op, double prescale, double postscale, int size);

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace hvd
