// One submitted op as the core tracks it until it completes.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>

#include "core/handles.h"
#include "wire/message.h"

namespace hvd {

// One op as submitted by Python. The request's rank, dtype, shape and device are
// filled in by Runtime::Submit from the tensor.
struct Submission {
  Request request;
  at::Tensor input;
  at::Tensor output;           // allreduce / broadcast: where the result goes (may alias input)
  int32_t process_set_id = 0;  // 0: all ranks
  // Allreduce of a CUDA floating-point tensor only (Compression.fp16/bf16 in the C++
  // gradient hooks): the dtype it is sent and reduced in. The request carries it;
  // the GPU backend casts while packing and back while unpacking.
  c10::optional<at::ScalarType> wire;
  // Join only: the CUDA device this rank's zeros go on while it has joined (hvd.join's
  // `device`; -1: the device of its last CUDA op).
  int32_t join_device = -1;
};

// A control op's submission: no tensor, the fields of `control` (its kind at least).
inline Submission ControlSubmission(ControlOp control, std::string name, int32_t process_set_id) {
  Submission s;
  s.request.type = OpType::kControl;
  s.request.control = std::move(control);
  s.request.name = std::move(name);
  s.process_set_id = process_set_id;
  return s;
}

struct Entry {
  Submission sub;
  std::shared_ptr<HandleState> handle;
  std::shared_ptr<GpuEvent> ready;  // CUDA tensors: recorded on the caller's stream
};

}  // namespace hvd
