// The best `size` values offered so far, descending, with their indices: the top-k scans' insertion list.
// Equal values keep the one offered first ahead (a scan in index order: the lower index first).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace fastgen_cpu {

struct BestK {
  float* values;     // size slots, caller-owned
  int64_t* indices;  // size slots, caller-owned
  int64_t size;
  int64_t filled = 0;

  // the admission threshold: -inf until every slot is filled
  float worst() const { return filled < size ? -std::numeric_limits<float>::infinity() : values[size - 1]; }

  void offer(float value, int64_t index) {
    if (filled == size && !(value > values[size - 1])) return;
    int64_t at = std::min(filled, size - 1);
    while (at > 0 && values[at - 1] < value) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = value;
    indices[at] = index;
    filled = std::min(filled + 1, size);
  }
};

}  // namespace fastgen_cpu
