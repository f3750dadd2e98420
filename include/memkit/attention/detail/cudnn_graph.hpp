// memkit/attention/detail/cudnn_graph.hpp — cuDNN's fused scaled-dot-product attention through the backend C API
// (cudnn_graph.h; no cudnn-frontend): one RAII descriptor wrapper, the forward and backward operation graphs, and
// the plans, cached per (device, dtype, shape, mask) behind a mutex. Not a public header: attention/cudnn.hpp
// includes it, only when MEMKIT_USE_CUDNN is defined under nvcc.
//
// NOT RUN ON A GPU YET: written and compiled without a device. On the build machine cuDNN itself finalized every
// tensor and operation descriptor of both graphs (tests/cudnn/attention_cudnn_test.cu, no GPU needed); engine
// selection, the plans and their execution need a device and have not run.
//
// The graphs follow the "composite" lowering cudnn-frontend emits for cuDNN before 9.21 (CompositeSDPANode,
// CompositeSDPABackwardNode, CompositeSoftmaxNode, CompositeDiagonalBandMaskNode): the same nodes in the same
// order, with the same dims, strides, data types, virtual and by-value tensors (compared tensor by tensor with
// cudnn-frontend's own graphs, bf16 B 2, Hq 8, S 256, D 64, causal / window / GQA / MQA; docs/attention.md):
//   forward:  S = Q K^T (fp32) -> S * scale -> [mask] -> softmax with Stats = max + log(sum exp) -> P (io type)
//             -> O = P V
//   backward: softmax_sum = rowsum(dO * O) (fp32, in the workspace) ; S = Q K^T * scale - Stats -> [mask] ->
//             P = exp(S) ; dV = P^T dO ; dS = P * (dO V^T - softmax_sum) * scale ; dK = dS^T Q ;
//             dQ = dS K (accumulated in fp32 in the workspace, then copied to dQ's type)
// Masks are diagonal bands built from index-generating pointwise nodes: the right bound keeps key j <= i + shift
// (causal: shift 0), the left bound keeps j > i - window. Stats is the natural-log log-sum-exp of the scaled
// scores of each row, fp32 [B, Hq, S, 1]: memkit's lse [B, Hq, S] bit for bit in layout and convention.
// Grouped-query heads: K and V have Hkv heads, broadcast over the Hq / Hkv query heads of a group by the
// matmuls; backward reduces dK and dV over the group with a reduction node.
#pragma once

#include "memkit/config.hpp"

// Empty unless cuDNN was asked for (MEMKIT_USE_CUDNN; CMake: -DMEMKIT_USE_CUDNN=ON) and nvcc compiles it.
#if defined(MEMKIT_USE_CUDNN) && MEMKIT_HAS_CUDA
#include <cudnn_graph.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail::cudnn_sdpa {

// The message of a failed cuDNN call: the status name and cuDNN's own last error text. After a heuristics query
// that text has a paragraph per engine configuration (about 400 bytes each), so the buffer is large: 1 KiB kept
// only the first engine's reason, which for the forward graph without a device is the misleading one.
inline std::string status_text(cudnnStatus_t status) {
  std::string text = cudnnGetErrorString(status);
  std::vector<char> detail(std::size_t{1} << 15, '\0');
  cudnnGetLastErrorString(detail.data(), detail.size());
  if (detail[0] != '\0') text += std::string(" (") + detail.data() + ")";
  return text;
}
inline void check(cudnnStatus_t status, const std::string& what) {
  if (status != CUDNN_STATUS_SUCCESS) throw error("attention (cuDNN): " + what + ": " + status_text(status));
}

// One backend descriptor, destroyed with its owner; move-only.
class descriptor {
 public:
  explicit descriptor(cudnnBackendDescriptorType_t type, const char* what = "descriptor") {
    check(cudnnBackendCreateDescriptor(type, &handle_), std::string("create ") + what);
  }
  descriptor(descriptor&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  descriptor& operator=(descriptor&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  descriptor(const descriptor&) = delete;
  descriptor& operator=(const descriptor&) = delete;
  ~descriptor() { reset(); }

  cudnnBackendDescriptor_t get() const noexcept { return handle_; }
  template <class V>
  descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t count,
                  const V* values, const char* what) {
    check(cudnnBackendSetAttribute(handle_, name, type, count, values), std::string("set ") + what);
    return *this;
  }
  descriptor& set_descriptor(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value, const char* what) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
  }
  descriptor& finalize(const char* what) {
    check(cudnnBackendFinalize(handle_), std::string("finalize ") + what);
    return *this;
  }
  // Finalize that reports cuDNN's status instead of throwing: a rejected plan is a fallback, not an error.
  cudnnStatus_t try_finalize() noexcept { return cudnnBackendFinalize(handle_); }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudnnBackendDestroyDescriptor(handle_);
    handle_ = nullptr;
  }
  cudnnBackendDescriptor_t handle_ = nullptr;
};

// The problem a plan is built for. The scale is not part of it: it is a by-value scalar given at each execution.
struct sdpa_key {
  int device = 0;
  bool backward = false;
  cudnnDataType_t io = CUDNN_DATA_BFLOAT16;  // bf16 or fp16
  std::int64_t batch = 0, query_heads = 0, kv_heads = 0, sequence = 0, head_dim = 0;
  bool causal = true;
  std::int64_t window = 0;
  auto tie() const {
    return std::tie(device, backward, io, batch, query_heads, kv_heads, sequence, head_dim, causal, window);
  }
  bool operator<(const sdpa_key& other) const { return tie() < other.tie(); }
};

// The unique ids of the tensors a caller binds in the variant pack (virtual tensors are numbered from 100 on).
enum uid : std::int64_t {
  uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_dout, uid_dq, uid_dk, uid_dv,
  uid_softmax_sum,  // backward: rowsum(dO * O), fp32 [B, Hq, S, 1], in the workspace
  uid_dq_accum,     // backward: dQ accumulated in fp32 [B, Hq, S, D], in the workspace
  uid_scale,        // by value: the softmax scale
  uid_first_constant = 20,  // by value: -inf, 1, the mask bounds (numbered in the order the graph makes them)
  uid_first_virtual = 100
};

// A by-value scalar of the graph: its uid and the 4 bytes the variant pack points to at execution.
struct constant {
  std::int64_t uid;
  std::array<unsigned char, 4> bytes;
};

// The operation nodes of one SDPA graph, each finalized by cuDNN (no device needed), with the tensors they
// reference kept alive beside them.
class graph_builder {
 public:
  explicit graph_builder(const sdpa_key& key) : key_(key) {}

  std::vector<descriptor>& operations() noexcept { return ops_; }
  // The ids of the graph's tensors in device memory (bound to pointers at execution), in the order made.
  const std::vector<std::int64_t>& memory_uids() const noexcept { return memory_uids_; }
  const std::deque<constant>& constants() const noexcept { return constants_; }
  std::int64_t tensor_count() const noexcept { return static_cast<std::int64_t>(tensors_.size()); }
  // Every tensor descriptor of the graph, in the order made (tests read their attributes back from cuDNN).
  const std::deque<descriptor>& tensors() const noexcept { return tensors_; }

  using dims = std::array<std::int64_t, 4>;
  static constexpr dims contiguous(const dims& d) noexcept { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

  cudnnBackendDescriptor_t tensor(std::int64_t id, const dims& d, const dims& strides, cudnnDataType_t type,
                                  bool is_virtual = false, bool by_value = false) {
    descriptor& t = tensors_.emplace_back(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor");
    const std::int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type")
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, d.data(), "tensor dimensions")
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides")
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id, "tensor unique id")
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor is-virtual");
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by-value");
    t.finalize("tensor descriptor");
    if (!is_virtual && !by_value) memory_uids_.push_back(id);
    return t.get();
  }
  // An intermediate tensor of the graph (never in memory outside cuDNN's kernels).
  cudnnBackendDescriptor_t virtual_tensor(const dims& d, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    return tensor(next_virtual_++, d, contiguous(d), type, true);
  }
  cudnnBackendDescriptor_t virtual_tensor(const dims& d, const dims& strides, cudnnDataType_t type) {
    return tensor(next_virtual_++, d, strides, type, true);
  }
  // A by-value scalar [1, 1, 1, 1]: fp32 or int32; its bytes are bound at execution.
  template <class V>
  cudnnBackendDescriptor_t scalar(V value, std::int64_t id = 0) {
    static_assert(sizeof(V) == 4);
    if (id == 0) {
      id = uid_first_constant + static_cast<std::int64_t>(constants_.size());
      constant c{id, {}};
      std::memcpy(c.bytes.data(), &value, 4);
      constants_.push_back(c);
    }
    return tensor(id, {1, 1, 1, 1}, {1, 1, 1, 1}, std::is_same_v<V, float> ? CUDNN_DATA_FLOAT : CUDNN_DATA_INT32,
                  false, true);
  }

  // y = mode(x [, b [, t]]), math in `math`; `axis` for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math = CUDNN_DATA_FLOAT,
                 std::int64_t axis = -1) {
    descriptor& pw = keep_.emplace_back(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise descriptor");
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode")
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, "pointwise math precision");
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
      pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise index axis");
    pw.finalize("pointwise descriptor");
    descriptor& op = ops_.emplace_back(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    const float one = 1.0f;
    op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get(), "pointwise operation's descriptor")
        .set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x")
        .set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
    if (b != nullptr) op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b");
    if (t != nullptr) op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha1")
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha2")
        .finalize("pointwise operation");
  }
  // c = a b over the last two dimensions, batched (and broadcast) over the first two; fp32 accumulation.
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    descriptor& mm = keep_.emplace_back(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul descriptor");
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "matmul compute type")
        .finalize("matmul descriptor");
    descriptor& op = ops_.emplace_back(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a")
        .set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul b")
        .set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul c")
        .set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get(), "matmul operation's descriptor")
        .finalize("matmul operation");
  }
  // y = reduce(x) over the dimensions where y has extent 1 (or fewer heads: a query-head group), fp32.
  void reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    descriptor& rd = keep_.emplace_back(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction descriptor");
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    rd.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce, "reduction operator")
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "reduction compute type")
        .finalize("reduction descriptor");
    descriptor& op = ops_.emplace_back(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x")
        .set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y")
        .set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd.get(), "reduction operation's descriptor")
        .finalize("reduction operation");
  }
  // y = x seen through other dimensions / strides (a transpose here).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    descriptor& op = ops_.emplace_back(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    op.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x")
        .set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y")
        .finalize("reshape operation");
  }

  // memkit's mask on scores s [B, Hq, S, S] (fp32): key j is kept for query i when (not causal or j <= i) and
  // (window == 0 or |i - j| < window). Returns s itself when nothing is masked.
  cudnnBackendDescriptor_t mask(cudnnBackendDescriptor_t s) {
    const dims scores{key_.batch, key_.query_heads, key_.sequence, key_.sequence};
    // Right bound: keep j <= i + shift (causal: 0; a window without causality: window - 1).
    if (key_.causal || key_.window > 0) {
      cudnnBackendDescriptor_t row = virtual_tensor(scores, CUDNN_DATA_INT32);
      cudnnBackendDescriptor_t col = virtual_tensor(scores, CUDNN_DATA_INT32);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
      if (!key_.causal) {
        cudnnBackendDescriptor_t shifted = virtual_tensor(scores, CUDNN_DATA_INT32);
        pointwise(CUDNN_POINTWISE_ADD, row, scalar(static_cast<std::int32_t>(key_.window - 1)), nullptr, shifted,
                  CUDNN_DATA_INT32);
        row = shifted;
      }
      cudnnBackendDescriptor_t keep = virtual_tensor(scores, CUDNN_DATA_BOOLEAN);
      pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
      cudnnBackendDescriptor_t masked = virtual_tensor(scores);
      pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, negative_infinity(), keep, masked);
      s = masked;
    }
    // Left bound: keep j + window > i.
    if (key_.window > 0) {
      cudnnBackendDescriptor_t row = virtual_tensor(scores, CUDNN_DATA_INT32);
      cudnnBackendDescriptor_t col = virtual_tensor(scores, CUDNN_DATA_INT32);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
      cudnnBackendDescriptor_t shifted = virtual_tensor(scores, CUDNN_DATA_FLOAT);
      pointwise(CUDNN_POINTWISE_ADD, col, scalar(static_cast<float>(key_.window)), nullptr, shifted);
      cudnnBackendDescriptor_t keep = virtual_tensor(scores, CUDNN_DATA_BOOLEAN);
      pointwise(CUDNN_POINTWISE_CMP_GT, shifted, row, nullptr, keep, CUDNN_DATA_BOOLEAN);
      cudnnBackendDescriptor_t masked = virtual_tensor(scores);
      pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, negative_infinity(), keep, masked);
      s = masked;
    }
    return s;
  }

 private:
  // What masked scores become: -inf, or the lowest float before cuDNN 9.1, whose engines preferred it (as
  // cudnn-frontend does; the version is the loaded library's).
  cudnnBackendDescriptor_t negative_infinity() {
    return scalar(cudnnGetVersion() < 91000 ? std::numeric_limits<float>::lowest()
                                            : -std::numeric_limits<float>::infinity());
  }

  sdpa_key key_;
  std::int64_t next_virtual_ = uid_first_virtual;
  std::deque<descriptor> tensors_;  // deque: references stay valid as it grows
  std::deque<descriptor> keep_;     // the pointwise / matmul / reduction descriptors the operations reference
  std::vector<descriptor> ops_;
  std::deque<constant> constants_;
  std::vector<std::int64_t> memory_uids_;
};

// The tensors a caller binds, in memkit's layouts: q, out, dout, dq [B, Hq, S, D] and k, v, dk, dv [B, Hkv, S, D]
// contiguous; stats (memkit's lse) [B, Hq, S] seen as [B, Hq, S, 1].
struct layouts {
  graph_builder::dims q, kv, stats, q_strides, kv_strides, stats_strides, kt, kt_strides;
  explicit layouts(const sdpa_key& k)
      : q{k.batch, k.query_heads, k.sequence, k.head_dim},
        kv{k.batch, k.kv_heads, k.sequence, k.head_dim},
        stats{k.batch, k.query_heads, k.sequence, 1},
        q_strides(graph_builder::contiguous(q)),
        kv_strides(graph_builder::contiguous(kv)),
        stats_strides{k.query_heads * k.sequence, k.sequence, 1, 1},
        // K (or V) read as its transpose [B, Hkv, D, S]: the same memory, strides swapped.
        kt{k.batch, k.kv_heads, k.head_dim, k.sequence},
        kt_strides{k.kv_heads * k.sequence * k.head_dim, k.sequence * k.head_dim, 1, k.head_dim} {}
};

// Forward: out and Stats (= lse) from q, k, v.
inline void build_forward(graph_builder& g, const sdpa_key& key) {
  const layouts l(key);
  const graph_builder::dims scores{key.batch, key.query_heads, key.sequence, key.sequence};
  const graph_builder::dims rows{key.batch, key.query_heads, key.sequence, 1};
  cudnnBackendDescriptor_t q = g.tensor(uid_q, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t kt = g.tensor(uid_k, l.kt, l.kt_strides, key.io);
  cudnnBackendDescriptor_t v = g.tensor(uid_v, l.kv, l.kv_strides, key.io);
  cudnnBackendDescriptor_t o = g.tensor(uid_o, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t stats = g.tensor(uid_stats, l.stats, l.stats_strides, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t scale = g.scalar(0.0f, uid_scale);

  cudnnBackendDescriptor_t s = g.virtual_tensor(scores);
  g.matmul(q, kt, s);
  cudnnBackendDescriptor_t scaled = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  s = g.mask(scaled);
  // Softmax with its statistics: max, exp(s - max), sum, Stats = max + log(sum), P = exp / sum.
  cudnnBackendDescriptor_t max = g.virtual_tensor(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, max);
  cudnnBackendDescriptor_t centered = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_SUB, s, max, nullptr, centered);
  cudnnBackendDescriptor_t e = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_EXP, centered, nullptr, nullptr, e);
  cudnnBackendDescriptor_t sum = g.virtual_tensor(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  cudnnBackendDescriptor_t log_sum = g.virtual_tensor(rows);
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, max, log_sum, nullptr, stats);
  // P in the io type: the second matmul's A operand is what its tensor cores read.
  cudnnBackendDescriptor_t p = g.virtual_tensor(scores, graph_builder::contiguous(scores), key.io);
  g.pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
  g.matmul(p, v, o);
}

// Backward: dq, dk, dv from q, k, v, out, Stats (= lse) and dout.
inline void build_backward(graph_builder& g, const sdpa_key& key) {
  const layouts l(key);
  const graph_builder::dims scores{key.batch, key.query_heads, key.sequence, key.sequence};
  const graph_builder::dims scores_t_strides{key.query_heads * key.sequence * key.sequence,
                                             key.sequence * key.sequence, 1, key.sequence};
  const graph_builder::dims rows{key.batch, key.query_heads, key.sequence, 1};
  const bool grouped = key.query_heads != key.kv_heads;
  cudnnBackendDescriptor_t q = g.tensor(uid_q, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t kt = g.tensor(uid_k, l.kt, l.kt_strides, key.io);
  cudnnBackendDescriptor_t vt = g.tensor(uid_v, l.kt, l.kt_strides, key.io);
  cudnnBackendDescriptor_t o = g.tensor(uid_o, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t stats = g.tensor(uid_stats, l.stats, l.stats_strides, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t dout = g.tensor(uid_dout, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t dq = g.tensor(uid_dq, l.q, l.q_strides, key.io);
  cudnnBackendDescriptor_t dk = g.tensor(uid_dk, l.kv, l.kv_strides, key.io);
  cudnnBackendDescriptor_t dv = g.tensor(uid_dv, l.kv, l.kv_strides, key.io);
  cudnnBackendDescriptor_t softmax_sum = g.tensor(uid_softmax_sum, rows, l.stats_strides, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t dq_accum = g.tensor(uid_dq_accum, l.q, l.q_strides, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t scale = g.scalar(0.0f, uid_scale);

  // softmax_sum = rowsum(dO * O) (memkit's delta), times 1 as the engines' pattern has it. The product's strides
  // are the ones cudnn-frontend's composite lowering gives it ([B, H, S, D] with a row stride of H * D, a layout
  // hint for a tensor that never exists in memory): the graph the SDPA engines are exercised with.
  const graph_builder::dims product_strides{key.query_heads * key.sequence * key.head_dim,
                                            key.sequence * key.head_dim, key.query_heads * key.head_dim, 1};
  cudnnBackendDescriptor_t product = g.virtual_tensor(l.q, product_strides, CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dout, o, nullptr, product);
  cudnnBackendDescriptor_t row_sum = g.virtual_tensor(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, product, row_sum);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sum, g.scalar(1.0f), nullptr, softmax_sum);
  // P = exp(scale * Q K^T - Stats), masked.
  cudnnBackendDescriptor_t s = g.virtual_tensor(scores);
  g.matmul(q, kt, s);
  cudnnBackendDescriptor_t scaled = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
  cudnnBackendDescriptor_t centered = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, centered);
  cudnnBackendDescriptor_t masked = g.mask(centered);
  cudnnBackendDescriptor_t p = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);
  // dV and dK are a product per query head, summed over each query-head group when K/V have fewer heads.
  const auto kv_gradient = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t out) {
    if (!grouped) {
      g.matmul(a, b, out);
      return;
    }
    cudnnBackendDescriptor_t per_head = g.virtual_tensor(l.q, l.q_strides, key.io);
    g.matmul(a, b, per_head);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, per_head, out);
  };
  // dV = P^T dO.
  cudnnBackendDescriptor_t pt = g.virtual_tensor(scores, scores_t_strides, key.io);
  g.reshape(p, pt);
  kv_gradient(pt, dout, dv);
  // dS = P * (dO V^T - softmax_sum) * scale.
  cudnnBackendDescriptor_t dp = g.virtual_tensor(scores);
  g.matmul(dout, vt, dp);
  cudnnBackendDescriptor_t dp_centered = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, dp_centered);
  cudnnBackendDescriptor_t ds_unscaled = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centered, p, nullptr, ds_unscaled);
  cudnnBackendDescriptor_t ds = g.virtual_tensor(scores);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);
  // dK = dS^T Q.
  cudnnBackendDescriptor_t dst = g.virtual_tensor(scores, scores_t_strides, key.io);
  g.reshape(ds, dst);
  kv_gradient(dst, q, dk);
  // dQ = dS K, accumulated in fp32 (workspace), then converted into dq. K's reshape (K^T seen as K) is an fp32
  // virtual tensor as in cudnn-frontend's lowering (the intermediate type; the engine reads K in the io type).
  cudnnBackendDescriptor_t k = g.virtual_tensor(l.kv, l.kv_strides, CUDNN_DATA_FLOAT);
  g.reshape(kt, k);
  g.matmul(ds, k, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
}

// Both graphs' nodes for `key`, every descriptor finalized by cuDNN. Needs no device (no handle is involved).
inline graph_builder build_graph(const sdpa_key& key) {
  graph_builder g(key);
  if (key.backward) build_backward(g, key);
  else build_forward(g, key);
  return g;
}

// --- Plans: what needs a device (a cuDNN handle). NOT RUN ON A GPU YET. ---

// A graph cuDNN accepted (an execution plan and its workspace), or why it did not.
struct plan {
  sdpa_key key;
  bool supported = false;
  std::string reason;          // when not supported: what cuDNN (or memkit) said
  std::int64_t workspace = 0;  // cuDNN's own workspace bytes for this plan
  std::unique_ptr<graph_builder> graph;
  std::unique_ptr<descriptor> operation_graph, engine_config, execution_plan;
};

// One handle per device, made on first use; executions on it are serialized (cudnnSetStream, then the enqueue).
// Never destroyed: destroying it during static destruction could run after the CUDA context is gone.
struct device_handle {
  cudnnHandle_t handle = nullptr;
  std::mutex execute;
};

inline std::shared_ptr<plan> make_plan(cudnnHandle_t handle, const sdpa_key& key) {
  auto result = std::make_shared<plan>();
  result->key = key;
  if (cudnnGetVersion() / 10000 != 9) {
    result->reason = "cuDNN " + std::to_string(cudnnGetVersion()) + " is loaded; these graphs are written for cuDNN 9";
    return result;
  }
  try {
    result->graph = std::make_unique<graph_builder>(build_graph(key));
  } catch (const error& e) {
    result->reason = std::string("graph rejected: ") + e.what();
    return result;
  }
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const descriptor& op : result->graph->operations()) ops.push_back(op.get());
  result->operation_graph = std::make_unique<descriptor>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  descriptor& graph = *result->operation_graph;
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<std::int64_t>(ops.size()),
            ops.data(), "operation graph's operations")
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph's handle");
  if (const cudnnStatus_t s = graph.try_finalize(); s != CUDNN_STATUS_SUCCESS) {
    result->reason = "operation graph rejected: " + status_text(s);
    return result;
  }
  // The heuristics' configurations in their order, mode A first, then the fallback list (as cudnn-frontend's
  // build({A, FALLBACK})); the first whose plan finalizes is taken. Anything cuDNN refuses becomes the reason.
  std::string why;
  const cudnnBackendDescriptor_t graph_handle = graph.get();
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics A" : "heuristics FALLBACK";
    descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph_handle,
                   "heuristics' operation graph")
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics' mode");
    if (const cudnnStatus_t s = heuristics.try_finalize(); s != CUDNN_STATUS_SUCCESS) {
      why += std::string(why.empty() ? "" : "; ") + mode_name + " failed: " + status_text(s);
      continue;
    }
    std::int64_t count = 0;
    if (const cudnnStatus_t s = cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
        s != CUDNN_STATUS_SUCCESS || count <= 0) {
      why += std::string(why.empty() ? "" : "; ") + mode_name + " offer no engine configuration (" +
             status_text(s) + ")";
      continue;
    }
    std::vector<descriptor> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (std::int64_t i = 0; i < count; ++i)
      raw.push_back(configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration").get());
    std::int64_t returned = 0;
    const cudnnStatus_t got_configs = cudnnBackendGetAttribute(
        heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, raw.data());
    // cuDNN's last message says why configurations were dropped, when they were.
    std::string last = status_text(got_configs);
    if (got_configs != CUDNN_STATUS_SUCCESS) returned = 0;
    for (std::int64_t i = 0; i < returned && i < count; ++i) {
      auto candidate = std::make_unique<descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      const cudnnBackendDescriptor_t config = configs[static_cast<std::size_t>(i)].get();
      candidate->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan's handle")
          .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config, "plan's engine");
      if (const cudnnStatus_t s = candidate->try_finalize(); s != CUDNN_STATUS_SUCCESS) {
        last = status_text(s);
        continue;
      }
      std::int64_t bytes = 0, got = 0;
      check(cudnnBackendGetAttribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                     &got, &bytes),
            "get the plan's workspace size");
      result->workspace = bytes;
      result->engine_config = std::make_unique<descriptor>(std::move(configs[static_cast<std::size_t>(i)]));
      result->execution_plan = std::move(candidate);
      result->supported = true;
      return result;
    }
    why += std::string(why.empty() ? "" : "; ") + "none of the " + std::to_string(returned) + " configurations of " +
           mode_name + " finalized (last: " + last + ")";
  }
  result->reason = "no engine: " + why;
  return result;
}

// The process's plans and handles, behind one mutex (plans are built once per problem and then only read).
class plan_cache {
 public:
  static plan_cache& instance() {
    static plan_cache* cache = new plan_cache;  // never destroyed: see device_handle
    return *cache;
  }
  // The handle of `device` (made with that device current). Throws memkit::error when cuDNN cannot make one.
  device_handle& handle(int device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    return handle_locked(device);
  }
  std::shared_ptr<const plan> get(const sdpa_key& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    std::shared_ptr<const plan> made = make_plan(handle_locked(key.device).handle, key);
    plans_.emplace(key, made);
    return made;
  }

 private:
  device_handle& handle_locked(int device) {
    std::unique_ptr<device_handle>& slot = handles_[device];
    if (!slot) {
      auto made = std::make_unique<device_handle>();
      ::memkit::detail::with_device(device, [&] {
        check(cudnnCreate(&made->handle), "cudnnCreate on device " + std::to_string(device));
        return 0;
      });
      slot = std::move(made);
    }
    return *slot;
  }
  std::mutex mutex_;
  std::map<int, std::unique_ptr<device_handle>> handles_;
  std::map<sdpa_key, std::shared_ptr<const plan>> plans_;
};

// Enqueues `p` on `stream` with the tensors bound by uid (`bindings`), the scale and the graph's constants by value,
// and `workspace` (p.workspace bytes; may be null when 0).
inline void execute(const sdpa_key& key, const plan& p, cudaStream_t stream,
                    const std::vector<std::pair<std::int64_t, void*>>& bindings, float scale, void* workspace) {
  std::vector<std::int64_t> uids;
  std::vector<void*> pointers;
  for (const auto& [id, pointer] : bindings) uids.push_back(id), pointers.push_back(pointer);
  // Every tensor of the graph in memory is bound, and nothing else: a mismatch is memkit's bug, said plainly.
  if (std::set<std::int64_t>(uids.begin(), uids.end()) !=
      std::set<std::int64_t>(p.graph->memory_uids().begin(), p.graph->memory_uids().end()))
    throw error("attention (cuDNN): the tensors bound do not match the graph's (memkit bug)");
  uids.push_back(uid_scale), pointers.push_back(&scale);
  // By-value scalars are read from host memory when the plan is enqueued.
  std::vector<std::array<unsigned char, 4>> values;
  for (const constant& c : p.graph->constants()) values.push_back(c.bytes);
  for (std::size_t i = 0; i < values.size(); ++i)
    uids.push_back(p.graph->constants()[i].uid), pointers.push_back(values[i].data());
  descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<std::int64_t>(uids.size()), uids.data(),
           "variant pack's ids")
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<std::int64_t>(pointers.size()),
           pointers.data(), "variant pack's pointers")
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "variant pack's workspace")
      .finalize("variant pack");
  device_handle& h = plan_cache::instance().handle(key.device);
  const std::lock_guard<std::mutex> lock(h.execute);
  ::memkit::detail::with_device(key.device, [&] {
    check(cudnnSetStream(h.handle, stream), "cudnnSetStream");
    check(cudnnBackendExecute(h.handle, p.execution_plan->get(), pack.get()), "cudnnBackendExecute");
    return 0;
  });
}

// Says once per configuration kind (not per call) on stderr that cuDNN's path was not taken, and why. Returns
// whether this call said it.
inline bool report_fallback_once(const std::string& kind, const std::string& reason) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!said.insert(kind).second) return false;
  std::fprintf(stderr, "memkit: attention (cuDNN path): %s: %s; memkit's built-in kernel runs instead\n", kind.c_str(),
               reason.c_str());
  return true;
}

}  // namespace attention::detail::cudnn_sdpa
MEMKIT_NAMESPACE_END
#endif  // MEMKIT_USE_CUDNN && MEMKIT_HAS_CUDA
