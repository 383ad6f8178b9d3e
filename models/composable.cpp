// Models of PyTorch's composable-API and FSDP core tests (docs/scenarios.md M10,
// M13, M15): UnitModule, CompositeModel, CompositeParamModel, NestedWrappedModule,
// MixtureOfExperts.
#include "models/layers.h"
#include "models/model_decl.h"

namespace composer::models {
namespace {

using nn::Linear;

// l1=Linear(d,d), seq=Sequential(ReLU, Linear(d,d), ReLU), l2=Linear(d,d).
class UnitModule : public Model {
 public:
  explicit UnitModule(int64_t d) : Model("UnitModule"), dim_(d) {
    l1 = add("l1", std::make_shared<Linear>(d, d));
    seq = add("seq", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                         std::make_shared<nn::ReLU>(), std::make_shared<Linear>(d, d),
                         std::make_shared<nn::ReLU>()}));
    l2 = add("l2", std::make_shared<Linear>(d, d));
  }
  torch::Tensor forward(torch::Tensor x) override { return (*l2)((*seq)((*l1)(x))); }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::shared_ptr<Linear> l1, l2;
  std::shared_ptr<nn::Sequential> seq;

 private:
  int64_t dim_;
};

// l1, u1=UnitModule, u2=UnitModule, l2; or, with a parameter p:
// l, u1, u2 and mm(u2(u1(l(x))), p).
class CompositeModel : public Model {
 public:
  CompositeModel(int64_t d, bool with_param)
      : Model(with_param ? "CompositeParamModel" : "CompositeModel"), dim_(d) {
    if (with_param) p = register_parameter("p", nn::new_param({d, d}, [](torch::Tensor& t) { t.normal_(); }));
    first = add(with_param ? "l" : "l1", std::make_shared<Linear>(d, d));
    u1 = add("u1", std::make_shared<UnitModule>(d));
    u2 = add("u2", std::make_shared<UnitModule>(d));
    if (!with_param) last = add("l2", std::make_shared<Linear>(d, d));
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto h = (*u2)((*u1)((*first)(x)));
    return p.defined() ? torch::mm(h, param(p)) : (*last)(h);
  }
  InputSpec input_spec() const override { return {false, dim_}; }
  std::shared_ptr<Linear> first, last;
  std::shared_ptr<UnitModule> u1, u2;
  torch::Tensor p;

 private:
  int64_t dim_;
};

// module = Sequential(Linear(8,4), Sequential(Linear(4,16), Linear(16,16)),
// Linear(16,4), Linear(4,8)); no activations.
class NestedWrappedModule : public Model {
 public:
  NestedWrappedModule() : Model("NestedWrappedModule") {
    auto inner = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
        std::make_shared<Linear>(4, 16), std::make_shared<Linear>(16, 16)});
    module = add("module", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                               std::make_shared<Linear>(8, 4), inner, std::make_shared<Linear>(16, 4),
                               std::make_shared<Linear>(4, 8)}));
  }
  torch::Tensor forward(torch::Tensor x) override { return (*module)(x); }
  InputSpec input_spec() const override { return {false, 8}; }
  std::shared_ptr<nn::Sequential> module;
};

// module = Sequential(Linear(8,12), shared=Linear(12,23), expert=Linear(23,12),
// Linear(12,8)); no activations. The expert is built first, as the seed builds
// it (under its own seed, 42 + rank there): a plan's per_rank_seed re-draws it
// per rank with the same first draws.
class MixtureOfExperts : public Model {
 public:
  MixtureOfExperts() : Model("MixtureOfExperts") {
    constexpr int64_t d_input = 8, d_shared = 12, d_expert = 23;
    auto expert = std::make_shared<Linear>(d_expert, d_shared);
    auto shared = std::make_shared<Linear>(d_shared, d_expert);
    auto in = std::make_shared<Linear>(d_input, d_shared);
    auto out = std::make_shared<Linear>(d_shared, d_input);
    module = add("module", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{in, shared, expert, out}));
  }
  torch::Tensor forward(torch::Tensor x) override { return (*module)(x); }
  InputSpec input_spec() const override { return {false, 8}; }
  std::shared_ptr<nn::Sequential> module;
};

ArgSpec dim_arg() { return int_arg("dim", 100, "width of every Linear"); }
void check_dim(const ModelArgs& a) { require_arg_positive(a, "dim"); }

ModelSpec unit_module() {
  return ModelDecl<UnitModule>("unit_module", "UnitModule: l1, seq=(ReLU, Linear, ReLU), l2")
      .args({dim_arg()})
      .check(check_dim)
      .build([](const ModelArgs& a) { return std::make_shared<UnitModule>(a.i("dim")); });
}

ModelSpec composite_model() {
  return ModelDecl<CompositeModel>("composite_model", "CompositeModel: l1, u1=UnitModule, u2=UnitModule, l2")
      .args({dim_arg()})
      .check(check_dim)
      .build([](const ModelArgs& a) { return std::make_shared<CompositeModel>(a.i("dim"), false); });
}

ModelSpec composite_param_model() {
  return ModelDecl<CompositeModel>("composite_param_model",
                                   "CompositeParamModel: l, u1, u2 and mm(., p) with a parameter p")
      .args({dim_arg()})
      .check(check_dim)
      .build([](const ModelArgs& a) { return std::make_shared<CompositeModel>(a.i("dim"), true); });
}

ModelSpec nested_wrapped_module() {
  return ModelDecl<NestedWrappedModule>("nested_wrapped_module",
                                        "NestedWrappedModule: Linear(8,4), (Linear(4,16), Linear(16,16)), "
                                        "Linear(16,4), Linear(4,8)")
      .build([](const ModelArgs&) { return std::make_shared<NestedWrappedModule>(); });
}

ModelSpec mixture_of_experts() {
  return ModelDecl<MixtureOfExperts>("mixture_of_experts",
                                     "MixtureOfExperts: Linear(8,12), shared Linear(12,23), expert Linear(23,12), "
                                     "Linear(12,8)")
      .build([](const ModelArgs&) { return std::make_shared<MixtureOfExperts>(); });
}

}  // namespace

// In registration order: the order of the registry and of the names in messages.
std::vector<ModelSpec> composable_specs() {
  return {unit_module(), composite_model(), composite_param_model(), nested_wrapped_module(), mixture_of_experts()};
}

}  // namespace composer::models
