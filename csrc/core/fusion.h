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
// (and so are consecutive reduce-scatters)
// while their total size stays within threshold_bytes; everything else is a
// batch of one. A single tensor larger than the threshold is a batch of one.
// With separate_groups (HOROVOD_DISABLE_GROUP_FUSION) only members of the same
// group (or ungrouped ops) are packed together.
std::vector<std::vector<size_t>> PlanFusion(const std::vector<Response>& responses,
                                            int64_t threshold_bytes, bool separate_groups = false);

// Whether this process set's new requests may wait for the GPU collectives it
// already enqueued to finish: only GPU allreduces and reduce-scatters, together
// smaller than the fusion threshold. They would queue behind that work anyway;
// meanwhile the gradients that become ready join them, so fewer and larger
// collectives go out.
bool WorthHolding(const std::vector<Request>& fresh, int64_t threshold_bytes);

// Bytes of an allreduce's (or a reduce-scatter's input) tensor.
int64_t ResponseBytes(const Response& r);

// The rows of a reduce-scatter's result each of `size` ranks keeps: its splits, or
// else dim 0 split evenly, the first (dim0 % size) ranks one row more.
std::vector<int64_t> ReducescatterRows(const Response& r, int size);

// A fused reduce-scatter's layout: the batch's inputs cut by rank and regrouped, so
// that rank p's part of every input lies together, in batch order. elems[i][p] is
// the number of elements of input i that rank p keeps; counts[p] their sum over the
// batch (what the collective reduces for rank p); src_offset[i][p] where input i's
// part for p starts in input i, and dst_offset[i][p] where it goes in the fused
// buffer. For one input the fused buffer is the input itself.
struct ScatterLayout {
  std::vector<std::vector<int64_t>> elems, src_offset, dst_offset;
  std::vector<size_t> counts;
  int64_t total = 0;
};
ScatterLayout PlanReducescatter(const std::vector<Response>& batch, int size);

}  // namespace hvd
