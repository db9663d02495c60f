// Element types and reduction operations shared by every layer. Raw buffers only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hvd {

// The one table of element types: X(name, value, text, bytes, torch) for each, where
// `torch` names c10's ScalarType (at::ScalarType::torch) for the layers that use torch
// (core/torch_types.h). The wire carries `value`; Python sees `text`.
#define HVD_DATA_TYPES(X)                  \
  X(kUInt8, 0, "uint8", 1, Byte)           \
  X(kInt8, 1, "int8", 1, Char)             \
  X(kInt16, 2, "int16", 2, Short)          \
  X(kInt32, 3, "int32", 4, Int)            \
  X(kInt64, 4, "int64", 8, Long)           \
  X(kFloat16, 5, "float16", 2, Half)       \
  X(kBFloat16, 6, "bfloat16", 2, BFloat16) \
  X(kFloat32, 7, "float32", 4, Float)      \
  X(kFloat64, 8, "float64", 8, Double)     \
  X(kBool, 9, "bool", 1, Bool)

// The one table of reduction ops: X(name, value, python_name), numbered as Horovod's
// Python constants (hvd.Average == 0, hvd.Sum == 1, ...; exported to Python as
// _C.REDUCE_OPS). A new op is a row here plus its kernels (docs/design.md §13c).
#define HVD_REDUCE_OPS(X)   \
  X(kAverage, 0, "Average") \
  X(kSum, 1, "Sum")         \
  X(kAdasum, 2, "Adasum")   \
  X(kMin, 3, "Min")         \
  X(kMax, 4, "Max")         \
  X(kProduct, 5, "Product")

#define HVD_ENUM_ROW(name, value, ...) name = value,
#define HVD_COUNT_ROW(...) +1
enum class DataType : uint8_t { HVD_DATA_TYPES(HVD_ENUM_ROW) };
enum class ReduceOp : uint8_t { HVD_REDUCE_OPS(HVD_ENUM_ROW) };
// Values run from 0 to these counts less one (the decoder and submission check them).
constexpr int kNumDataTypes = 0 HVD_DATA_TYPES(HVD_COUNT_ROW);
constexpr int kNumReduceOps = 0 HVD_REDUCE_OPS(HVD_COUNT_ROW);
#undef HVD_ENUM_ROW
#undef HVD_COUNT_ROW

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
