// The element-type table (common/types.h's HVD_DATA_TYPES) on torch's side: the
// DataType of a tensor and the torch dtype of a DataType.
#pragma once

#include <ATen/ATen.h>

#include "common/types.h"

namespace hvd {

// False for a torch dtype the engine does not carry (complex, float8, ...).
inline bool ToDataType(at::ScalarType t, DataType* out) {
  switch (t) {
#define HVD_FROM_TORCH_ROW(name, value, text, bytes, torch) \
  case at::ScalarType::torch:                               \
    *out = DataType::name;                                  \
    return true;
    HVD_DATA_TYPES(HVD_FROM_TORCH_ROW)
#undef HVD_FROM_TORCH_ROW
    default:
      return false;
  }
}

inline at::ScalarType TorchType(DataType dtype) {
  switch (dtype) {
#define HVD_TO_TORCH_ROW(name, value, text, bytes, torch) \
  case DataType::name:                                    \
    return at::ScalarType::torch;
    HVD_DATA_TYPES(HVD_TO_TORCH_ROW)
#undef HVD_TO_TORCH_ROW
  }
  return at::ScalarType::Undefined;
}

}  // namespace hvd
