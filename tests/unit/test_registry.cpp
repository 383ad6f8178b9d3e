// The model registry and module base: every model builds with PyTorch's FQNs,
// tied weights appear once, hooks and parameter views work.
#include <gtest/gtest.h>

#include "models/layers.h"
#include "models/registry.h"
#include "runner/config/config.h"
#include "runner/train/build.h"
#include "tests/unit/small_args.h"

namespace composer {
namespace {

models::ModelArgs defaults(const models::ModelSpec& s) {
  models::ModelArgs a;
  for (const auto& arg : s.args) a.set(arg.name, arg.default_value);
  return a;
}

std::vector<std::string> names_of(models::Model& m) {
  std::vector<std::string> out;
  for (auto& [n, p] : nn::unique_named_parameters(m)) out.push_back(n);
  return out;
}

TEST(Registry, EveryModelBuildsAndRunsForward) {
  ASSERT_GE(models::registry().size(), 13u);
  for (const auto& spec : models::registry()) {
    auto args = testing::small_args(spec);
    auto model = spec.build(args);
    auto in = model->input_spec();
    // transformer_with_shared_params's samples have one length: src and tgt of the seed's input.
    const int64_t seq =
        spec.name == "transformer_with_shared_params" ? in.max_seq_len : std::min<int64_t>(in.max_seq_len, 8);
    auto x = in.tokens ? torch::zeros({2, seq}, torch::kLong)
                       : torch::randn({2, in.features});
    auto y = (*model)(x);
    EXPECT_EQ(y.size(0), 2) << spec.name;
    EXPECT_FALSE(names_of(*model).empty()) << spec.name;
  }
}

TEST(Registry, UnknownNameIsNull) { EXPECT_EQ(models::find_model("nope"), nullptr); }

// The planner's messages list these, in registration order. A model declared
// with one of these capabilities joins its list here.
TEST(Registry, CapabilitiesNameTheModelsThatHaveThem) {
  using models::Capability;
  EXPECT_EQ(models::listed_names_with(Capability::kPipeline),
            "mlp_module_layers, mlp_stack, mlp_seq, transformer, llama, qwen3, deepseek_v3");
  EXPECT_EQ(models::listed_names_with(Capability::kTpPlan),
            "mlp_module, mlp_module_even, mlp_module_layers, mlp, mlp_stack, simple_model, simple_model_uneven, "
            "transformer, llama, qwen3, deepseek_v3");
  EXPECT_EQ(models::listed_names_with(Capability::kContextParallel), "transformer, llama, qwen3, deepseek_v3");
  EXPECT_EQ(models::listed_names_with(Capability::kLogits), "transformer, llama, qwen3, deepseek_v3");
  EXPECT_EQ(models::names_with(Capability::kLogits),
            (std::vector<std::string>{"transformer", "llama", "qwen3", "deepseek_v3"}));
}

// What a built model does is what its declaration says, for every model.
TEST(Registry, BuiltModelsDoWhatTheirDeclarationsSay) {
  for (const auto& spec : models::registry()) {
    auto model = spec.build(testing::small_args(spec));
    EXPECT_EQ(!model->pipeline_pieces().empty(), spec.has(models::Capability::kPipeline)) << spec.name;
    EXPECT_EQ(model->sequence_slot() != nullptr, static_cast<bool>(spec.sequence_slot)) << spec.name;
    EXPECT_EQ(static_cast<bool>(spec.tp_plan), static_cast<bool>(spec.tp_check)) << spec.name;
    if (spec.has(models::Capability::kLogits)) {
      EXPECT_TRUE(model->named_parameters().contains(spec.logits + ".weight")) << spec.name;
    }
  }
}

TEST(Registry, MLPStackHasPyTorchNames) {
  auto spec = models::find_model("mlp_stack");
  auto args = defaults(*spec);
  args.set("with_seq_parallel", true);
  auto m = spec->build(args);
  std::vector<std::string> want = {"0.in_proj.weight", "0.in_proj.bias", "0.out_proj.weight", "0.out_proj.bias",
                                   "1.in_proj.weight", "1.in_proj.bias", "1.out_proj.weight", "1.out_proj.bias",
                                   "2.in_proj.weight", "2.in_proj.bias", "2.out_proj.weight", "2.out_proj.bias",
                                   "3.weight"};
  EXPECT_EQ(names_of(*m), want);
  EXPECT_EQ(m->named_parameters()["0.in_proj.weight"].sizes(), (std::vector<int64_t>{48, 16}));
}

TEST(Registry, TransformerTiesOutputToEmbeddingOnce) {
  auto spec = models::find_model("transformer");
  auto m = spec->build(defaults(*spec));
  auto names = names_of(*m);
  EXPECT_EQ(names.front(), "tok_embeddings.weight");
  EXPECT_EQ(std::count(names.begin(), names.end(), "output.weight"), 0);
  EXPECT_NE(std::find(names.begin(), names.end(), "layers.1.feed_forward.w2.bias"), names.end());
  auto all = m->named_parameters();
  EXPECT_TRUE(all["output.weight"].is_same(all["tok_embeddings.weight"]));
}

TEST(Registry, LlamaShapesFollowTorchtitan) {
  auto spec = models::find_model("llama");
  auto a = defaults(*spec);  // dim 256, 16 heads, multiple_of 256: hidden int(2*1024/3)=682 -> 768
  a.set("n_layers", int64_t{1});
  a.set("n_kv_heads", int64_t{4});
  auto m = spec->build(a);
  auto p = m->named_parameters();
  EXPECT_EQ(p["layers.0.feed_forward.w1.weight"].sizes(), (std::vector<int64_t>{768, 256}));
  EXPECT_EQ(p["layers.0.attention.wk.weight"].sizes(), (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(p["output.weight"].sizes(), (std::vector<int64_t>{256, 256}));
}

TEST(Registry, CompositeParamModelOwnsPFirst) {
  auto spec = models::find_model("composite_param_model");
  auto m = spec->build(defaults(*spec));
  auto names = names_of(*m);
  EXPECT_EQ(names.front(), "p");
  EXPECT_EQ(names[1], "l.weight");
  EXPECT_NE(std::find(names.begin(), names.end(), "u2.seq.1.weight"), names.end());
}

TEST(Registry, NestedWrappedModuleNames) {
  auto spec = models::find_model("nested_wrapped_module");
  auto names = names_of(*spec->build({}));
  std::vector<std::string> want = {"module.0.weight",   "module.0.bias", "module.1.0.weight", "module.1.0.bias",
                                   "module.1.1.weight", "module.1.1.bias", "module.2.weight", "module.2.bias",
                                   "module.3.weight",   "module.3.bias"};
  EXPECT_EQ(names, want);
}

TEST(Registry, SeededInitIsDeterministic) {
  auto c = parse_config("name: t\nseed: 7\nmodel: {name: simple_model}\n", "x.yaml");
  auto a = build_model(c), b = build_model(c);
  for (auto& [n, p] : nn::unique_named_parameters(*a)) EXPECT_TRUE(p.equal(b->named_parameters()[n])) << n;
  c.seed = 8;
  auto d = build_model(c);
  EXPECT_FALSE(d->named_parameters()["net1.weight"].equal(a->named_parameters()["net1.weight"]));
}

TEST(ModuleBase, HooksWrapForward) {
  nn::Linear lin(3, 2);
  std::vector<std::string> calls;
  lin.add_pre_hook([&](nn::Module&, torch::Tensor x) {
    calls.push_back("pre");
    return x * 2;
  });
  int post = lin.add_post_hook([&](nn::Module&, const torch::Tensor&, torch::Tensor y) {
    calls.push_back("post");
    return y + 1;
  });
  auto x = torch::ones({1, 3});
  auto expect = torch::linear(x * 2, lin.weight, lin.bias) + 1;
  EXPECT_TRUE(torch::allclose(lin(x), expect));
  EXPECT_EQ(calls, (std::vector<std::string>{"pre", "post"}));
  lin.remove_hook(post);
  EXPECT_TRUE(torch::allclose(lin(x), expect - 1));
}

TEST(ModuleBase, ParameterViewsReplaceWhatTheLayerSees) {
  nn::Linear lin(3, 2, false);
  auto x = torch::ones({1, 3});
  lin.set_view(lin.weight, torch::zeros({2, 3}));
  EXPECT_TRUE(lin(x).eq(0).all().item<bool>());
  lin.clear_view(lin.weight);
  EXPECT_TRUE(torch::allclose(lin(x), torch::linear(x, lin.weight)));
}

}  // namespace
}  // namespace composer
