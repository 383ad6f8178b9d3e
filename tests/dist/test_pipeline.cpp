// pipeline on real Gloo groups (ranks are threads): every schedule computes
// the single-device gradients, and under fully_shard the units stay gathered
// across microbatches and reduce-scatter once, after the last. The
// zero-bubble schedules' W action computes the Linear weight gradients from
// what I kept, without traversing the stage's graph again.
#include <gtest/gtest.h>

#include <functional>
#include <set>

#include "models/layers.h"
#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/pipeline/pipeline.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

models::ModelPtr make_layers() {
  return testing::seeded_model("mlp_module_layers", 5, {{"n_layers", int64_t{8}}, {"dim", int64_t{10}}});
}

torch::Tensor microbatch(int mb) { return torch::linspace(-1, 1, 20).view({2, 10}).mul(mb + 1).cos(); }

// Single-device gradients of sum over microbatches of output.sum().
std::map<std::string, torch::Tensor> reference_grads(int microbatches) {
  auto ref = make_layers();
  for (int mb = 0; mb < microbatches; ++mb) (*ref)(microbatch(mb)).sum().backward();
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : nn::unique_named_parameters(*ref)) out[n] = p.grad();
  return out;
}

// Cuts `m` into this rank's stages, with the stage shapes traced on a copy
// of the same model that holds every stage (parallelize traces a shape-only
// copy on meta tensors, whose kernels composer registers in runner/estimate).
std::unique_ptr<Pipeline> cut(models::Model& m, Group& pp, const PipelineOptions& o, const torch::Tensor& example) {
  auto pipe = std::make_unique<Pipeline>(m, pp, o);
  models::ModelPtr copy = make_layers();
  PipelineOptions every = o;
  every.every_stage = true;
  Pipeline twin(*copy, pp, every);
  pipe->set_shapes(twin.trace(example));
  return pipe;
}

// Whether one of the pipeline's stages on this rank computes with module `fqn`.
bool runs(const Pipeline& pipe, const std::string& fqn) {
  for (const auto& root : pipe.roots()) {
    for (const auto& [name, m] : root.modules) {
      if (name == fqn) return true;
    }
  }
  return false;
}

PipelineOptions options(ScheduleKind kind, int microbatches) {
  PipelineOptions o;
  o.schedule = kind;
  o.virtual_stages = kind == ScheduleKind::kGpipe || kind == ScheduleKind::k1f1b ? 1 : 2;
  o.microbatches = microbatches;
  return o;
}

TEST(Pipeline, EveryScheduleComputesTheSingleDeviceGradients) {
  const auto ref = reference_grads(4);
  for (auto kind : {ScheduleKind::kGpipe, ScheduleKind::k1f1b, ScheduleKind::kInterleaved1f1b, ScheduleKind::kLoopedBfs,
                    ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv}) {
    testing::run_ranks({"pp"}, {2}, [&](DeviceMesh& mesh) {
      auto& pp = mesh.group("pp");
      auto m = make_layers();
      auto cut_model = cut(*m, pp, options(kind, 4), microbatch(0));
      Pipeline& pipe = *cut_model;
      double loss = pipe.run(microbatch, [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
      auto t = torch::tensor({loss}, torch::kDouble);
      all_reduce(pp, t);
      double expect = 0;
      {
        auto ref_model = make_layers();
        torch::NoGradGuard no_grad;
        for (int mb = 0; mb < 4; ++mb) expect += (*ref_model)(microbatch(mb)).sum().item<double>();
      }
      EXPECT_NEAR(t.item<double>(), expect, 1e-4) << name_of(kind);
      for (auto& [n, p] : nn::unique_named_parameters(*m)) {
        if (!pipe.holds(p)) {
          EXPECT_EQ(p.numel(), 0) << n << ": a stage this rank does not hold keeps no storage";
          continue;
        }
        EXPECT_TRUE(torch::allclose(p.grad(), ref.at(n), 1e-5, 1e-6)) << name_of(kind) << " " << n;
      }
    });
  }
}

// Data parallel over 2 ranks: rank r's microbatch mb at step s, distinct for
// every rank and step, so an average over the ranks differs from either
// rank's own gradient.
torch::Tensor dp_microbatch(int step, int rank, int mb) { return microbatch(mb + 4 * rank + 8 * step); }
constexpr double kLr = 0.1;

// Single-device: `steps` SGD steps (lr kLr) on the mean over the 2 ranks of
// the sum over 4 microbatches; the last step's gradients.
std::map<std::string, torch::Tensor> reference_dp_grads(int steps) {
  auto ref = make_layers();
  std::map<std::string, torch::Tensor> out;
  for (int s = 0; s < steps; ++s) {
    for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
    for (int r = 0; r < 2; ++r) {
      for (int mb = 0; mb < 4; ++mb) ((*ref)(dp_microbatch(s, r, mb)).sum() / 2).backward();
    }
    torch::NoGradGuard no_grad;
    for (auto& [n, p] : nn::unique_named_parameters(*ref)) {
      out[n] = p.grad().clone();
      p.sub_(kLr * p.grad());
    }
  }
  return out;
}

// Runs `steps` pipelined steps on this rank's shards (SGD lr kLr on them
// between steps) and checks the last step's shard gradients against one
// device. `each_step` runs after a step's pipeline, before the flush.
void check_fully_shard_pipeline(DeviceMesh& mesh, ScheduleKind kind, bool reshard, int steps,
                                const std::map<std::string, torch::Tensor>& ref,
                                const std::function<void(Group& dp, int step)>& each_step) {
  auto& dp = mesh.group("dp");
  auto& pp = mesh.group("pp");
  auto m = make_layers();
  auto cut_model = cut(*m, pp, options(kind, 4), microbatch(0));
  Pipeline& pipe = *cut_model;
  FullyShardOptions o;
  o.units = {"layers.*"};
  o.reshard_after_forward = reshard;
  auto fs = apply_fully_shard(pipe.roots(), dp, o);  // each of this rank's stages is a root
  EXPECT_EQ(fs->num_units(), 4u);  // this rank's 4 layers
  for (int s = 0; s < steps; ++s) {
    for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
    dp.counter->reset();
    fs->set_requires_sync(false);
    pipe.run([&](int mb) { return dp_microbatch(s, dp.rank, mb); },
             [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
    each_step(dp, s);
    fs->flush();
    EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 4) << "step " << s << ": once per unit, after the last";
    fs->reshard();
    if (s + 1 == steps) break;
    torch::NoGradGuard no_grad;
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      if (pipe.holds(p) && p.grad().defined()) p.sub_(kLr * p.grad());
    }
  }
  for (auto& [n, p] : nn::unique_named_parameters(*m)) {
    if (!pipe.holds(p)) continue;
    auto expect = ref.at(n).chunk(2, 0)[dp.rank];
    ASSERT_TRUE(p.grad().defined()) << name_of(kind) << " " << n;
    EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6))
        << name_of(kind) << " reshard " << reshard << " " << n << ": " << (p.grad() - expect).abs().max().item<double>();
  }
}

TEST(Pipeline, FullyShardGathersOnceAndReduceScattersOnceAfterTheLastMicrobatch) {
  // Two steps, so the second gathers the updated shards (and prefetches).
  const auto ref = reference_dp_grads(2);
  testing::run_ranks({"dp", "pp"}, {2, 2}, [&](DeviceMesh& mesh) {
    check_fully_shard_pipeline(mesh, ScheduleKind::k1f1b, /*reshard=*/false, 2, ref, [](Group& dp, int s) {
      EXPECT_EQ(dp.counter->get("all_gather").calls, 4) << "step " << s << ": once per unit, not per microbatch";
      EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 0) << "step " << s << ": none before the flush";
    });
  });
}

TEST(Pipeline, ZeroBubbleUnderFullyShardComputesTheSingleDeviceGradients) {
  // W delivers the weight gradients through fully_shard's all-gather node, a
  // second time per microbatch after I; with reshard_after_forward the
  // unsharded storage may be freed by then (W does not read it).
  const auto ref = reference_dp_grads(2);
  for (auto kind : {ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv}) {
    for (bool reshard : {true, false}) {
      testing::run_ranks({"dp", "pp"}, {2, 2}, [&](DeviceMesh& mesh) {
        check_fully_shard_pipeline(mesh, kind, reshard, 2, ref, [](Group&, int) {});
      });
    }
  }
}

TEST(Pipeline, ZeroBubbleTraversesEachStageOnceAndComputesEachWeightGradientOnce) {
  // Every Linear on a rank counts the gradients its output receives (each
  // traversal of the stage's graph computes one) and the defined gradients
  // its weight receives. A W that re-ran the stage's backward would give the
  // outputs of stages after the first two gradients per microbatch.
  constexpr int kMicrobatches = 4;
  for (auto kind : {ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv, ScheduleKind::k1f1b}) {
    testing::run_ranks({"pp"}, {2}, [&](DeviceMesh& mesh) {
      auto& pp = mesh.group("pp");
      auto m = make_layers();
      auto cut_model = cut(*m, pp, options(kind, kMicrobatches), microbatch(0));
      Pipeline& pipe = *cut_model;
      struct Counts {
        int output_grads = 0, weight_grads = 0;
      };
      std::map<std::string, Counts> counts;
      for (auto& [fqn, mod] : nn::named_modules(*m)) {
        auto* lin = dynamic_cast<nn::Linear*>(mod);
        if (!lin || !runs(pipe, fqn)) continue;
        Counts* c = &counts[fqn];
        lin->add_post_hook([c](nn::Module&, const torch::Tensor&, torch::Tensor y) {
          y.register_hook([c](const torch::Tensor&) { ++c->output_grads; });
          return y;
        });
        lin->weight.register_hook([c](const torch::Tensor& g) {
          if (g.defined()) ++c->weight_grads;
        });
      }
      ASSERT_EQ(counts.size(), 8u);  // 4 MLPModules of 2 Linears
      pipe.run(microbatch, [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
      for (const auto& [fqn, c] : counts) {
        EXPECT_EQ(c.output_grads, kMicrobatches) << name_of(kind) << " " << fqn << ": one traversal per microbatch";
        EXPECT_EQ(c.weight_grads, kMicrobatches) << name_of(kind) << " " << fqn << ": one weight gradient per microbatch";
      }
    });
  }
}

TEST(Pipeline, DeferredLinearGradientsEqualThePlainBackwardBitwise) {
  // The deferred mode on a whole model (3-D activations, a tied output
  // weight, norms and embeddings): one backward leaves only the Linear
  // weights and biases without gradients, and the records then give them
  // exactly (same matmuls as autograd's).
  for (const std::string name : {"transformer", "mlp_module_layers", "llama"}) {
    std::map<std::string, models::ArgValue> args;
    if (name == "transformer") args["dropout_p"] = 0.0;
    auto plain = testing::seeded_model(name, 3, args);
    auto deferred = testing::seeded_model(name, 3, args);
    const auto spec = plain->input_spec();
    torch::Tensor x;
    {
      std::lock_guard<std::mutex> lock(testing::rng_mutex());
      torch::manual_seed(7);
      x = spec.tokens ? torch::randint(0, spec.vocab_size, {2, std::min<int64_t>(8, spec.max_seq_len)})
                      : torch::randn({3, 5, spec.features});
    }
    (*plain)(x).sin().sum().backward();
    nn::WeightGradRecords records;
    {
      nn::DeferWeightGrads defer(&records);
      (*deferred)(x).sin().sum().backward();
    }
    ASSERT_FALSE(records.empty()) << name;
    std::set<const c10::TensorImpl*> linear_params, others;
    for (auto& [fqn, mod] : nn::named_modules(*deferred)) {
      for (auto& p : mod->parameters(/*recurse=*/false)) {
        (dynamic_cast<nn::Linear*>(mod) ? linear_params : others).insert(p.unsafeGetTensorImpl());
      }
    }
    for (auto& [n, p] : nn::unique_named_parameters(*deferred)) {
      const bool linear_only = linear_params.count(p.unsafeGetTensorImpl()) && !others.count(p.unsafeGetTensorImpl());
      EXPECT_EQ(p.grad().defined(), !linear_only) << name << " " << n << ": before W";
    }
    records.backward();
    EXPECT_TRUE(records.empty());
    auto ref = nn::unique_named_parameters(*plain);
    auto got = nn::unique_named_parameters(*deferred);
    ASSERT_EQ(ref.size(), got.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(got[i].second.grad().defined()) << name << " " << got[i].first;
      EXPECT_TRUE(torch::equal(got[i].second.grad(), ref[i].second.grad())) << name << " " << got[i].first;
    }
  }
}

}  // namespace
}  // namespace composer::parallel

namespace composer::parallel {
namespace {

// What a rank's log says, bytes aside (a program does not know them).
std::vector<std::string> without_bytes(const P2PLog& log) {
  std::vector<std::string> out;
  for (const P2PEvent& e : log) {
    std::string s = (e.kind == P2PEvent::kIssue ? "issue " : "wait ") + e.comm + " " + std::to_string(e.group);
    for (const P2PRecord& op : e.ops) {
      s += " " + op.label + (op.send ? ">" : "<") + std::to_string(op.peer) + "#" + std::to_string(op.tag);
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace

// The sequence the runtime issues, recorded over Gloo, is its program's, in
// both orders (the checker proves the programs); and NCCL's grouped order run
// over Gloo computes the posted order's gradients and losses bit for bit.
TEST(Pipeline, TheRuntimeIssuesItsProgramInBothOrders) {
  for (auto kind : {ScheduleKind::kGpipe, ScheduleKind::k1f1b, ScheduleKind::kInterleaved1f1b, ScheduleKind::kLoopedBfs,
                    ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv}) {
    testing::run_ranks({"pp"}, {2}, [&](DeviceMesh& mesh) {
      auto& pp = mesh.group("pp");
      std::map<std::string, torch::Tensor> grads[2];
      double losses[2] = {0, 0};
      for (const P2POrder order : {P2POrder::kPosted, P2POrder::kGrouped}) {
        const int i = order == P2POrder::kGrouped;
        PipelineOptions o = options(kind, 4);
        o.p2p_order = order;
        auto m = make_layers();
        auto pipe = cut(*m, pp, o, microbatch(0));
        P2PRecorder recorder;
        losses[i] = pipe->run(microbatch, [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
        {
          torch::NoGradGuard no_grad;
          pipe->evaluate(microbatch, [](int, const torch::Tensor& y) { return y.sum(); });
        }
        const PipelineShape& shape = pipe->shape();
        const auto lists = with_communication(compute_schedule(kind, shape), shape);
        std::vector<RankActions> evaluation;
        for (int r = 0; r < shape.pp; ++r) evaluation.push_back(evaluation_actions(shape, r));
        P2PLog expected = program_log(p2p_programs(lists, order)[pp.rank], shape, pp.ranks, comm_key(pp));
        P2PLog eval = program_log(p2p_programs(evaluation, order)[pp.rank], shape, pp.ranks, comm_key(pp));
        ASSERT_FALSE(expected.empty());
        int groups = 0;
        for (const P2PEvent& e : expected) groups += e.kind == P2PEvent::kIssue;
        for (P2PEvent e : eval) {  // the evaluation's groups continue the numbering
          e.group += groups;
          expected.push_back(e);
        }
        EXPECT_EQ(without_bytes(recorder.log()), without_bytes(expected)) << name_of(kind) << " order " << i;
        for (const P2PEvent& e : recorder.log()) {
          for (const P2PRecord& op : e.ops) EXPECT_GT(op.bytes, 0) << op.label;
        }
        for (auto& [n, p] : nn::unique_named_parameters(*m)) {
          if (pipe->holds(p)) grads[i][n] = p.grad();
        }
      }
      EXPECT_EQ(losses[0], losses[1]) << name_of(kind);
      ASSERT_EQ(grads[0].size(), grads[1].size());
      for (auto& [n, g] : grads[0]) EXPECT_TRUE(torch::equal(g, grads[1].at(n))) << name_of(kind) << " " << n;
    });
  }
}

}  // namespace composer::parallel
