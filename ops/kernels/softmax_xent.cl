// Fused softmax + cross-entropy over logits [rows, classes] with int32 labels. Operands are
// (buffer, element offset) pairs; the label offset counts int32 elements.
//
// Reductions are deterministic: each work-item accumulates a fixed strided subset in order, then
// the work-group combines the partial results (reduce.clh).

#include "reduce.clh"
#include "store16.clh"

// lse[r] = log sum_c exp(logits[r, c]), max-subtracted, one work-group per row. Nothing of size
// [rows, classes] is written: the backward recomputes the probabilities from the logits and lse.
__kernel void softmax_xent_lse(__global const float* logits, ulong logits_off, __global float* lse, ulong lse_off,
                               uint classes, __local float* scratch) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), ls = get_local_size(0);
  __global const float* x = logits + logits_off + row * classes;
  float m = -INFINITY;
  for (uint c = lid; c < classes; c += ls) m = fmax(m, x[c]);
  m = group_max(m, scratch);
  float s = 0.0f;
  for (uint c = lid; c < classes; c += ls) s += exp(x[c] - m);
  s = group_sum(s, scratch);
  if (lid == 0) lse[lse_off + row] = m + log(s);
}

// stats[0] = mean over rows of -log softmax(logits)[label] = lse - logits[label] (finite where the
// label's probability underflows), stats[1] = rows whose argmax (first index on ties) equals the
// label; one work-group, a work-item per row (strided). A label outside [0, classes) gives NaN.
__kernel void softmax_xent_stats(__global const float* logits, ulong logits_off, __global const float* lse,
                                 ulong lse_off, __global const int* labels, ulong labels_off, __global float* stats,
                                 ulong stats_off, uint rows, uint classes, __local float* scratch) {
  const uint lid = get_local_id(0), ls = get_local_size(0);
  float loss = 0.0f, correct = 0.0f;
  for (uint r = lid; r < rows; r += ls) {
    __global const float* x = logits + logits_off + (ulong)r * classes;
    uint best = 0;
    float best_value = x[0];
    for (uint c = 1; c < classes; ++c) {
      const float v = x[c];
      if (v > best_value) {
        best_value = v;
        best = c;
      }
    }
    const int label = labels[labels_off + r];
    if (label < 0 || (uint)label >= classes) {
      loss += NAN;
      continue;
    }
    loss += lse[lse_off + r] - x[label];
    correct += (uint)label == best ? 1.0f : 0.0f;
  }
  loss = group_sum(loss, scratch);
  correct = group_sum(correct, scratch);
  if (lid == 0) {
    stats[stats_off] = loss / (float)rows;
    stats[stats_off + 1] = correct;
  }
}

// dlogits = coef * (exp(logits - lse) - onehot(label)), coef = scale / rows; NaN for rows with a
// bad label. dlogits may be logits' memory.
__kernel void softmax_xent_backward(__global const float* logits, ulong logits_off, __global const float* lse,
                                    ulong lse_off, __global const int* labels, ulong labels_off,
                                    __global float* dlogits, ulong dlogits_off, uint rows, uint classes, float coef) {
  const size_t i = get_global_id(0);
  if (i >= (size_t)rows * classes) return;
  const uint r = (uint)(i / classes), c = (uint)(i - (size_t)r * classes);
  const int label = labels[labels_off + r];
  float g = exp(logits[logits_off + i] - lse[lse_off + r]) - ((uint)label == c ? 1.0f : 0.0f);
  if (label < 0 || (uint)label >= classes) g = NAN;
  dlogits[dlogits_off + i] = coef * g;
}

// CPU devices: the same lse with a work-item per row, 16 classes at a time as one float16 (PoCL's
// vector exp; the classes past the last whole 16 one by one). Global: rows.
__kernel void softmax_xent_lse16(__global const float* logits, ulong logits_off, __global float* lse, ulong lse_off,
                                 uint rows, uint classes) {
  const uint row = get_global_id(0);
  if (row >= rows) return;
  __global const float* x = logits + logits_off + (ulong)row * classes;
  const uint whole = classes / 16 * 16;
  float16 mv = -INFINITY;
  for (uint c = 0; c < whole; c += 16) mv = fmax(mv, vload16(0, x + c));
  float m = fold_max16(mv);
  for (uint c = whole; c < classes; ++c) m = fmax(m, x[c]);
  float16 sv = 0.0f;
  for (uint c = 0; c < whole; c += 16) sv += exp(vload16(0, x + c) - m);
  float s = fold_sum16(sv);
  for (uint c = whole; c < classes; ++c) s += exp(x[c] - m);
  lse[lse_off + row] = m + log(s);
}

// CPU devices: the backward with a work-item per row and 16 classes (one float16). Global:
// rows * ceil(classes / 16).
__kernel void softmax_xent_backward16(__global const float* logits, ulong logits_off, __global const float* lse,
                                      ulong lse_off, __global const int* labels, ulong labels_off,
                                      __global float* dlogits, ulong dlogits_off, uint rows, uint classes, float coef) {
  const uint chunks = (classes + 15) / 16;
  const uint k = get_global_id(0);
  const uint r = k / chunks, c0 = (k - r * chunks) * 16;
  if (r >= rows) return;
  const int label = labels[labels_off + r];
  const bool bad = label < 0 || (uint)label >= classes;
  const float l = lse[lse_off + r];
  const ulong at = (ulong)r * classes + c0;
  if (c0 + 16 <= classes) {
    const int16 lane = (int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) + (int)c0;
    float16 g = exp(vload16(0, logits + logits_off + at) - l) - select((float16)(0.0f), (float16)(1.0f), lane == label);
    if (bad) g = NAN;
    VSTORE16_GLOBAL(coef * g, dlogits + dlogits_off + at);
    return;
  }
  for (uint c = c0; c < classes; ++c) {
    float g = exp(logits[logits_off + (ulong)r * classes + c] - l) - ((uint)label == c ? 1.0f : 0.0f);
    if (bad) g = NAN;
    dlogits[dlogits_off + (ulong)r * classes + c] = coef * g;
  }
}
