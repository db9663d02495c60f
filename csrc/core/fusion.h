// Fusion planning: which consecutive responses run as one collective. Pure
// function of the (identical on every rank) response list, so every rank fuses
// the same way. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "wire/message.h"

namespace hvd {

// Splits `responses` into batches of indices, in order. Consecutive allreduce
// responses without error, with equal dtype, op and scale factors, are packed
// while their total size stays within threshold_bytes; everything else is a
// batch of one. A single tensor larger than the threshold is a batch of one.
// With separate_groups (HOROVOD_DISABLE_GROUP_FUSION) only members of the same
// group (or ungrouped ops) are packed together.
std::vector<std::vector<size_t>> PlanFusion(const std::vector<Response>& responses,
                                            int64_t threshold_bytes, bool separate_groups = false);

// Whether this process set's new requests may wait for the GPU collectives it
// already enqueued to finish: only GPU allreduces, together smaller than the
// fusion threshold. They would queue behind that work anyway; meanwhile the
// gradients that become ready join them, so fewer and larger collectives go out.
bool WorthHolding(const std::vector<Request>& fresh, int64_t threshold_bytes);

// Bytes of an allreduce response's tensor.
int64_t ResponseBytes(const Response& r);

}  // namespace hvd
