// memkit/layers/parameters.hpp — the parameter registry: every trainable (parameter, gradient) pair of a
// model, by name, collected from the layers themselves, and handed to the optimizer in one place.
//
//   layers::parameter_registry<bf16> params({{.name = "decay", .weight_decay = 0.1f}, {.name = "no_decay", .weight_decay = 0.0f}},
//                                           [](const std::string&, const shape& s) { return s.rank >= 2 ? 0 : 1; });
//   model.register_parameters(params);       // each layer: params.add(weight); ... (frozen ones are skipped)
//   optim::adam_state<float> adam(exec, resource, params.sizes(), options);   // sizes in registration order
//   const auto adam_params = params.adam_params();                     // the same order, with their groups
//   ... layers::zero_grad(exec, params); forward; backward;
//   adam.step(exec, adam_params, params.adam_groups(base, lr));        // lr * each group's lr_scale
//
// Without a registry, a caller lists adam_state's sizes and its adam_params by hand, in the same order; a
// wrong order of equal-sized tensors then goes unnoticed. The registry keeps one list: names are unique,
// each gradient has its parameter's shape and memory kind (so has the master copy, when there is one), and
// sizes(), adam_params() and zero_grad() all walk it in registration order.
//
// Groups say what differs between tensors in the optimizer (weight decay on or off, a learning-rate scale);
// a tensor's group is given when it is added, or chosen by the registry's group_rule from its name and shape
// (how a layer's register_parameters, which knows nothing of groups, lands in the right one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/layers/parameter.hpp"
#include "memkit/layers/tensor_ops.hpp"
#include "memkit/optim/adam_state.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace layers {

// What a group of tensors does differently in the optimizer.
struct parameter_group {
  std::string name = "default";
  std::optional<float> weight_decay{};  // unset: the base optimizer group's
  float lr_scale = 1.0f;                // the group's learning rate is lr * lr_scale
};

// One registered tensor: views of its value, gradient and (optional) fp32 master copy, and its group.
template <class P, class G = float>
struct registered_parameter {
  std::string name;
  tensor_view<P> value;
  tensor_view<G> grad;
  tensor_view<float> master;  // none when the value is the master
  int group = 0;
};

template <class P, class G = float>
class parameter_registry {
 public:
  using entry = registered_parameter<P, G>;
  // The group of a tensor added without one, from its name and shape.
  using group_rule = std::function<int(const std::string& name, const shape& dims)>;

  // One group, "default"; every tensor in it.
  parameter_registry() : parameter_registry(std::vector<parameter_group>{parameter_group{}}) {}
  explicit parameter_registry(std::vector<parameter_group> groups, group_rule rule = {});

  // Adds one tensor to group `group`. Refused (memkit::error, nothing added): an empty or repeated name, an
  // absent or empty value, an absent gradient, a gradient or master copy of another shape or memory kind,
  // an unknown group.
  void add(std::string name, tensor_view<P> value, tensor_view<G> grad, tensor_view<float> master, int group);
  // The same, the group chosen by the group_rule (group 0 without one).
  void add(std::string name, tensor_view<P> value, tensor_view<G> grad, tensor_view<float> master = tensor_view<float>::none()) {
    const int group = rule_ ? rule_(name, value.shape()) : 0;
    add(std::move(name), value, grad, master, group);
  }
  // A layer's parameter under its own name: skipped when frozen (it has no gradient).
  void add(basic_parameter<P>& p)
    requires std::is_same_v<G, float>
  {
    if (p.trains()) add(p.name, p.value.view(), p.grad.view(), p.master_view());
  }

  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  const std::vector<entry>& entries() const noexcept { return entries_; }
  const std::vector<parameter_group>& groups() const noexcept { return groups_; }
  // The tensor registered as `name`, or null.
  const entry* find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &entries_[it->second];
  }
  // Element counts in registration order (what adam_state's constructor and bytes_required take).
  std::vector<std::int64_t> sizes() const {
    std::vector<std::int64_t> list;
    list.reserve(entries_.size());
    for (const entry& e : entries_) list.push_back(e.value.size());
    return list;
  }
  std::int64_t parameter_count() const noexcept {
    std::int64_t n = 0;
    for (const entry& e : entries_) n += e.value.size();
    return n;
  }

  // ---- the optimizer: adam_state's tensors and groups, in the order of sizes() ----
  std::vector<optim::adam_param<P, G>> adam_params() const {
    std::vector<optim::adam_param<P, G>> list;
    list.reserve(entries_.size());
    for (const entry& e : entries_) list.push_back({e.value, tensor_view<const G>(e.grad), e.master, e.group});
    return list;
  }
  // One adam_group per registry group: `base` with lr = lr * lr_scale and the group's weight decay (when set).
  std::vector<optim::adam_group> adam_groups(const optim::adam_group& base, float lr) const {
    std::vector<optim::adam_group> list(groups_.size(), base);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      list[g].lr = lr * groups_[g].lr_scale;
      if (groups_[g].weight_decay) list[g].weight_decay = *groups_[g].weight_decay;
    }
    return list;
  }

 private:
  std::vector<parameter_group> groups_;
  group_rule rule_;
  std::vector<entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
};

// Zeroes every registered gradient, ordered on exec's stream (a memset on the host, cudaMemsetAsync on
// exec.stream on a CUDA executor). Refused before any is touched when the executor cannot reach one.
template <executor E, class P, class G>
void zero_grad(const E& exec, const parameter_registry<P, G>& registry) {
  for (const auto& e : registry.entries()) require_accessible(exec, e.grad, "layers::zero_grad", e.name.c_str());
  for (const auto& e : registry.entries()) zero_view(exec, e.grad);
}

// ---- implementation ----------------------------------------------------------------------------------------
template <class P, class G>
parameter_registry<P, G>::parameter_registry(std::vector<parameter_group> groups, group_rule rule)
    : groups_(std::move(groups)), rule_(std::move(rule)) {
  require(!groups_.empty(), "layers::parameter_registry: needs at least one group");
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (std::size_t h = 0; h < g; ++h)
      require(groups_[h].name != groups_[g].name,
              "layers::parameter_registry: two groups are named \"" + groups_[g].name + "\"");
    require(groups_[g].lr_scale >= 0.0f, "layers::parameter_registry: group \"" + groups_[g].name + "\" has a negative lr_scale");
  }
}

template <class P, class G>
void parameter_registry<P, G>::add(std::string name, tensor_view<P> value, tensor_view<G> grad, tensor_view<float> master,
                                   int group) {
  const std::string who = "layers::parameter_registry::add: \"" + name + "\"";
  require(!name.empty(), "layers::parameter_registry::add: a parameter needs a name");
  require(index_.find(name) == index_.end(), who + " is already registered");
  require(!value.is_none() && !value.empty(), who + ": the parameter is absent or empty");
  require(!grad.is_none(), who + ": no gradient (a frozen parameter is not registered)");
  require(grad.shape() == value.shape(),
          who + ": the gradient has shape " + to_string(grad.shape()) + ", the parameter " + to_string(value.shape()));
  require(grad.where() == value.where(), who + ": the gradient and the parameter are in different kinds of memory");
  require(master.is_none() || master.shape() == value.shape(),
          who + ": the master copy has shape " + to_string(master.shape()) + ", the parameter " + to_string(value.shape()));
  require(master.is_none() || master.where() == value.where(),
          who + ": the master copy and the parameter are in different kinds of memory");
  require(group >= 0 && static_cast<std::size_t>(group) < groups_.size(),
          who + ": group " + std::to_string(group) + " does not exist (" + std::to_string(groups_.size()) + " groups)");
  index_.emplace(name, entries_.size());
  entries_.push_back(entry{std::move(name), value, grad, master, group});
}

}  // namespace layers
MEMKIT_NAMESPACE_END
