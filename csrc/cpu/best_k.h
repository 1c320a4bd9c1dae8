// The best `size` values offered so far, descending, with their indices: the top-k scans' insertion list.
// Equal values keep the one offered first ahead (a scan in index order: the lower index first).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "vec.h"

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

// Offers row[0..n) to `best` in index order; whether the row holds a NaN. Each vector is compared with the
// current threshold and only its lanes above it are offered: once the slots are filled a new entry is rare,
// but it comes ~size * log(n / size) times a row, scattered, and a scan of every element of each block holding
// one cost 2x this (a beam step's 64 rows x 6,000).
inline bool scan_best(const float* row, int64_t n, BestK& best) {
  bool nan = false;
  int64_t i = 0;
  for (; i < n && best.filled < best.size; ++i) {  // until every slot holds a value, each one goes in
    nan = nan || row[i] != row[i];
    best.offer(row[i], i);
  }
  vint odd = {};
  float worst = best.worst();
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat x = load(row + i);
    odd |= x != x;
    uint32_t above = greater_mask(x, worst);  // a superset of what offer() admits: the threshold only rises
    if (above == 0) continue;
    for (; above != 0; above &= above - 1) {  // in index order: ties keep the lower index
      const int j = __builtin_ctz(above);
      best.offer(row[i + j], i + j);
    }
    worst = best.worst();
  }
  for (; i < n; ++i) {
    nan = nan || row[i] != row[i];
    best.offer(row[i], i);
  }
  for (int j = 0; j < kLanes; ++j) nan = nan || odd[j] != 0;
  return nan;
}

}  // namespace fastgen_cpu
