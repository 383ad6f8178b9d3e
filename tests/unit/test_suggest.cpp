// composer suggest's search and cost model: every plan it writes reads back
// (through the config reader and the planner) as the shape it priced, at the
// same price; each term moves with its own rate; the rates survive their JSON;
// the explanation names the term that decides; the memory floor the search
// prunes with lies under every dry run's peak; uneven pipelines get split points.
#include <gtest/gtest.h>

#include <fstream>

#include "runner/suggest/search.h"
#include "runner/suggest/suggest.h"
#include "temp_path.h"

namespace composer {
namespace {

using namespace suggest_detail;

// A small mixture-of-experts Llama: 4 layers, 4 routed experts, 4 ranks.
const char* kMoe = R"(name: suggest_unit_moe
seed: 0
model:
  name: llama
  args: {dim: 64, n_layers: 4, n_heads: 4, n_kv_heads: 2, vocab_size: 64, multiple_of: 32, max_seq_len: 32,
         n_experts: 4, top_k: 2, n_shared_experts: 1, moe_hidden_dim: 64}
train:
  steps: 3
  global_batch: 8
  optimizer: {name: sgd, lr: 0.1}
  loss: {name: cross_entropy}
data: {seq_len: 32}
)";

MachineRates given_rates() {
  MachineRates r;
  r.source = "given";
  r.matmul_flops = 50e9;
  r.elementwise_bytes_per_s = 10e9;
  r.kernel_s = 20e-6;
  r.intra = {2e-3, 0.5e9};
  r.inter = {4e-3, 0.25e9};
  r.intra_by_size[2] = {1e-3, 0.6e9};
  r.intra_by_size[4] = {2e-3, 0.5e9};
  return r;
}

World world4() {
  World w;
  w.ranks_per_node = 4;
  w.memory_per_rank = int64_t{4} << 30;
  w.rates = given_rates();
  return w;
}

std::string write_config(const std::string& text) {
  const std::string path = testing::temp_path("config.yaml");
  std::ofstream(path) << text;
  return path;
}

TEST(SuggestShapes, EveryPlanWrittenReadsBackAsItsShapeAtItsPrice) {
  World w = world4();
  const Suggestion s = suggest(write_config(kMoe), {}, w, 8, 24, 1e9);
  ASSERT_GE(s.fitting.size(), 4u);
  int64_t expert_parallel = 0;
  for (const auto* list : {&s.fitting, &s.unfit}) {
    for (const Candidate& cand : *list) {
      const ExperimentConfig c = parse_config(cand.yaml, "suggested.yaml");
      const Plan plan = make_plan(c, 4);
      const Shape shape = shape_of(c, plan);
      EXPECT_EQ(shape.name(), cand.name) << cand.yaml;
      EXPECT_DOUBLE_EQ(price(shape, facts_of(c), c, w).step_s(), cand.step_s()) << cand.name;
      EXPECT_LE(cand.floor, static_cast<double>(cand.peak)) << cand.name;
    }
  }
  for (const auto* list : {&s.fitting, &s.unfit, &s.others}) {
    for (const Candidate& cand : *list) expert_parallel += cand.name.find(".ep") != std::string::npos;
  }
  EXPECT_GT(expert_parallel, 0) << "the search of a model with routed experts tries expert_parallel";
  for (size_t i = 1; i < s.fitting.size(); ++i) EXPECT_LE(s.fitting[i - 1].step_s(), s.fitting[i].step_s());
}

// A small dense Llama of `layers` layers and `batch` samples a step.
const char* kDeepSeek = R"(name: suggest_unit_deepseek
seed: 0
model:
  name: deepseek_v3
  args: {dim: 64, n_layers: 4, n_heads: 4, vocab_size: 64, multiple_of: 32, max_seq_len: 32, hidden_dim: 96,
         q_lora_rank: 32, kv_lora_rank: 32, qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16,
         n_dense_layers: 1, n_experts: 8, top_k: 2, n_group: 4, topk_group: 2, n_shared_experts: 1,
         moe_hidden_dim: 32, route_scale: 2.5, expert_bias: true}
train:
  steps: 3
  global_batch: 8
  optimizer: {name: adamw, lr: 0.001}
  loss: {name: cross_entropy}
data: {seq_len: 32}
)";

std::string dense_llama(int layers, int batch) {
  return "name: suggest_unit_dense\nseed: 0\nmodel:\n  name: llama\n  args: {dim: 64, n_layers: " +
         std::to_string(layers) +
         ", n_heads: 4, n_kv_heads: 2, vocab_size: 64, multiple_of: 32, max_seq_len: 32}\ntrain:\n  steps: 3\n"
         "  global_batch: " + std::to_string(batch) +
         "\n  optimizer: {name: adamw, lr: 0.001}\n  loss: {name: cross_entropy}\ndata: {seq_len: 32}\n";
}

// The largest per-rank peak of `s`'s plan of `text` on `w`, run dry, and the plan's memory floor.
std::pair<int64_t, double> peak_and_floor(const std::string& text, const Shape& s, const World& w) {
  const YAML::Node doc = YAML::Load(text);
  const ExperimentConfig one = parse_config(text, "x.yaml");
  const ModelFacts f = facts_of(one);
  const ExperimentConfig c = parse_config(config_of(s, f, doc, text, 0, ""), "x.yaml");
  const Plan plan = make_plan(c, w.size());
  EXPECT_EQ(shape_of(c, plan).name(), s.name());
  int64_t peak = 0;
  for (const auto& e : estimate_memory(c, plan, w.ranks_per_node)) peak = std::max(peak, e.peak());
  return {peak, memory_floor(s, f, one, w)};
}

TEST(SuggestMemoryFloor, LiesUnderTheDryRunOfEachKindOfPlan) {
  auto shape = [](int64_t tp, int64_t cp, int64_t pp, int64_t dp, DpMode mode, Ac ac) {
    Shape s;
    s.tp = tp, s.cp = cp, s.pp = pp, s.dp = dp, s.dp_mode = mode, s.ac = ac;
    return s;
  };
  World w8 = world4();
  w8.nodes = 2;
  std::vector<Shape> dense;
  dense.push_back(shape(1, 1, 1, 8, DpMode::kReplicate, Ac::kNone));
  dense.push_back(shape(2, 1, 1, 4, DpMode::kFullyShard, Ac::kFull));
  dense.push_back(shape(2, 1, 2, 2, DpMode::kFullyShard, Ac::kOp));
  dense.back().tp_style = 2, dense.back().keep = true, dense.back().microbatches = 4;
  dense.push_back(shape(1, 1, 4, 2, DpMode::kReplicate, Ac::kNone));  // 6 layers on 4 stages: 2, 2, 1, 1
  dense.back().microbatches = 4;
  dense.push_back(shape(2, 1, 2, 2, DpMode::kFullyShard, Ac::kFull));
  dense.back().schedule = parallel::ScheduleKind::kInterleaved1f1b, dense.back().virtual_stages = 2;
  dense.back().microbatches = 4, dense.back().ac_every = 2;
  dense.push_back(shape(1, 2, 2, 2, DpMode::kFullyShard, Ac::kNone));
  dense.back().schedule = parallel::ScheduleKind::kZbv, dense.back().virtual_stages = 2, dense.back().microbatches = 4;
  dense.push_back(shape(2, 4, 1, 1, DpMode::kFullyShard, Ac::kOp));
  dense.back().rotate = 1;
  dense.push_back(shape(1, 1, 1, 8, DpMode::kHsdp, Ac::kNone));
  dense.back().shard = 4;
  for (const Shape& s : dense) {
    const auto [peak, floor] = peak_and_floor(dense_llama(6, 8), s, w8);  // 6 layers: uneven over 4 stages
    EXPECT_GT(floor, 0) << s.name();
    EXPECT_LE(floor, static_cast<double>(peak)) << s.name();
  }
  std::vector<Shape> moe;
  moe.push_back(shape(1, 1, 1, 1, DpMode::kNone, Ac::kNone));
  moe.back().ep = 4;  // its own dim
  moe.push_back(shape(1, 1, 1, 4, DpMode::kFullyShard, Ac::kOp));
  moe.back().ep = 4, moe.back().ep_borrows_dp = true;
  moe.push_back(shape(2, 1, 1, 1, DpMode::kNone, Ac::kFull));
  moe.back().ep = 2, moe.back().tp_style = 2;
  moe.push_back(shape(1, 1, 2, 1, DpMode::kNone, Ac::kNone));  // interleaved: its first rank holds stages 0 and 2
  moe.back().ep = 2, moe.back().schedule = parallel::ScheduleKind::kInterleaved1f1b, moe.back().virtual_stages = 2;
  moe.back().microbatches = 4;
  for (const Shape& s : moe) {
    const auto [peak, floor] = peak_and_floor(kMoe, s, world4());
    EXPECT_GT(floor, 0) << s.name();
    EXPECT_LE(floor, static_cast<double>(peak)) << s.name();
  }
  // DeepSeek-V3's shape: a dense first layer beside routed ones, each counted at its own widths
  std::vector<Shape> deepseek;
  deepseek.push_back(shape(1, 1, 2, 2, DpMode::kFullyShard, Ac::kNone));
  deepseek.back().microbatches = 2, deepseek.back().keep = true;
  deepseek.push_back(shape(1, 1, 1, 4, DpMode::kFullyShard, Ac::kFull));
  deepseek.back().ep = 4, deepseek.back().ep_borrows_dp = true;
  deepseek.push_back(shape(1, 1, 2, 1, DpMode::kNone, Ac::kOp));
  deepseek.back().ep = 2, deepseek.back().schedule = parallel::ScheduleKind::kZbv, deepseek.back().virtual_stages = 2;
  deepseek.back().microbatches = 4;
  for (const Shape& s : deepseek) {
    const auto [peak, floor] = peak_and_floor(kDeepSeek, s, world4());
    EXPECT_GT(floor, 0) << s.name();
    EXPECT_LE(floor, static_cast<double>(peak)) << s.name();
  }
}


TEST(SuggestPeak, FromFewerDryRunsIsTheFullEstimatesPeak) {
  auto pipeline = [](parallel::ScheduleKind kind, int64_t pp, int64_t m, Ac ac) {
    Shape s;
    s.pp = pp, s.schedule = kind, s.microbatches = m, s.ac = ac;
    s.virtual_stages = kind == parallel::ScheduleKind::k1f1b ? 1 : 2;
    return s;
  };
  using parallel::ScheduleKind;
  std::vector<Shape> shapes;  // 20 layers over 8 stages: 3, 3, 3, 3, 2, 2, 2, 2
  shapes.push_back(pipeline(ScheduleKind::k1f1b, 8, 8, Ac::kNone));
  shapes.push_back(pipeline(ScheduleKind::k1f1b, 4, 8, Ac::kOp));  // 5 layers a stage, cp 2
  shapes.back().cp = 2;
  shapes.push_back(pipeline(ScheduleKind::k1f1b, 4, 8, Ac::kFull));
  shapes.back().dp = 2, shapes.back().dp_mode = DpMode::kFullyShard;
  shapes.push_back(pipeline(ScheduleKind::kInterleaved1f1b, 4, 8, Ac::kNone));  // 20 layers on 8 stages
  shapes.back().tp = 2;
  shapes.push_back(pipeline(ScheduleKind::kInterleaved1f1b, 8, 8, Ac::kFull));  // 16 stages: 2, 2, 2, 2, 1, ...
  const std::string deep = dense_llama(20, 16);  // deep pipelines with many microbatches
  const YAML::Node doc = YAML::Load(deep);
  const ExperimentConfig one = parse_config(deep, "x.yaml");
  const ModelFacts f = facts_of(one);
  for (const Shape& s : shapes) {
    const ExperimentConfig c = parse_config(config_of(s, f, doc, deep, 0, ""), "x.yaml");
    const Plan plan = make_plan(c, 8);
    int64_t peak = 0;
    for (const auto& e : estimate_memory(c, plan, 8)) peak = std::max(peak, e.peak());
    EXPECT_EQ(estimate_peak(c, plan, 8), peak) << s.name();
    // Stopped where a step passes the limit: never at the peak itself, and at half of it the limit + 1.
    EXPECT_EQ(estimate_peak(c, plan, 8, peak), peak) << s.name();
    EXPECT_EQ(estimate_peak(c, plan, 8, peak / 2), peak / 2 + 1) << s.name();
    EXPECT_EQ(estimate_peak(c, plan, 8), peak) << s.name();  // and the count is whole again after a stop
  }
}

TEST(SuggestShapes, UnevenPipelinesGetSplitPointsLongestFirst) {
  Shape s;
  s.pp = 8;
  // the 405B example's own split: 16 layers on the first six stages, 15 on the last two
  EXPECT_EQ(pipeline_split_points(s, 126), (std::vector<std::string>{"layers.16", "layers.32", "layers.48", "layers.64",
                                                                      "layers.80", "layers.96", "layers.111"}));
  EXPECT_EQ(s.busiest_layers(126), 16);
  EXPECT_TRUE(pipeline_split_points(s, 64).empty());
  s.pp = 2, s.virtual_stages = 2;
  EXPECT_EQ(pipeline_split_points(s, 6), (std::vector<std::string>{"layers.2", "layers.4", "layers.5"}));
  EXPECT_EQ(s.busiest_layers(6), 4);  // the first rank: stages 0 and 2, two layers each
}

Shape tp2_dp2() {
  Shape s;
  s.tp = 2, s.dp = 2, s.dp_mode = DpMode::kFullyShard;
  return s;
}

TEST(SuggestCost, EachTermMovesWithItsOwnRate) {
  const ExperimentConfig c = parse_config(kMoe, "x.yaml");
  const ModelFacts f = facts_of(c);
  World w = world4();
  const StepTerms base = price(tp2_dp2(), f, c, w);
  EXPECT_GT(base.tp_s, 0);
  EXPECT_GT(base.dp_s, 0);
  EXPECT_EQ(base.ep_s, 0);
  w.rates.intra_by_size[2].latency_s *= 2;  // the tp group and the dp group: 2 ranks each
  const StepTerms slower = price(tp2_dp2(), f, c, w);
  EXPECT_GT(slower.tp_s, base.tp_s);
  EXPECT_DOUBLE_EQ(slower.matmul_s, base.matmul_s);
  w = world4();
  w.rates.latency_fit = w.rates.bandwidth_fit = 2;
  EXPECT_DOUBLE_EQ(price(tp2_dp2(), f, c, w).comm_s(), 2 * base.comm_s());
  EXPECT_GT(base.comm_latency_s, 0);
  EXPECT_LT(base.comm_latency_s, base.raw_comm_s());
  w = world4();
  Shape full = tp2_dp2();
  full.ac = Ac::kFull;
  const StepTerms recomputed = price(full, f, c, w);
  EXPECT_NEAR(recomputed.matmul_s, base.matmul_s * 4 / 3, 1e-12);  // one more forward: a third of the matmuls
  EXPECT_GT(recomputed.recompute_s, 0);
  Shape keep = tp2_dp2();
  keep.keep = true;
  EXPECT_LT(price(keep, f, c, w).dp_s, base.dp_s);  // no second all-gather in backward
  Shape keep4 = keep, reshard4 = tp2_dp2();
  keep4.microbatches = reshard4.microbatches = 4;
  // kept gathered to the step's end: one all-gather a step whatever the microbatches; resharded, two each
  EXPECT_DOUBLE_EQ(price(keep4, f, c, w).dp_s, price(keep, f, c, w).dp_s);
  EXPECT_GT(price(reshard4, f, c, w).dp_s, 2 * base.dp_s);
  Shape ep = tp2_dp2();
  ep.tp = 1, ep.dp = 2, ep.ep = 2;
  EXPECT_GT(price(ep, f, c, w).ep_s, 0);
}

// A rank idle in a pipeline's bubble leaves its core to the ranks still computing. Where 4 ranks share 2
// cores, 2 stages (a dp pair each) always keep both cores busy: no bubble. 4 stages leave a core idle
// where one stage runs alone: less than on cores of their own, more than nothing.
TEST(SuggestCost, TheBubbleOnSharedCoresIsWhatLeavesACoreIdle) {
  const ExperimentConfig c = parse_config(kMoe, "x.yaml");
  const ModelFacts f = facts_of(c);
  World w = world4();
  Shape pp2;
  pp2.pp = 2, pp2.dp = 2, pp2.dp_mode = DpMode::kReplicate, pp2.microbatches = 2;
  Shape pp4;
  pp4.pp = 4, pp4.microbatches = 4;
  const StepTerms own = price(pp2, f, c, w), own4 = price(pp4, f, c, w);  // cores not known: a core a rank
  const double busy = own.matmul_s + own.elementwise_s + own.kernels_s;
  ASSERT_GT(own.bubble, 0);
  EXPECT_NEAR(own.bubble_s, busy * own.bubble / (1 - own.bubble), 1e-12);
  w.rates.cores = 2, w.rates.ranks = 4, w.rates.threads = 1;
  EXPECT_DOUBLE_EQ(w.rates.core_share(), 0.5);
  EXPECT_NEAR(price(pp2, f, c, w).bubble_s, 0, 1e-12);
  const double shared4 = price(pp4, f, c, w).bubble_s;
  EXPECT_GT(shared4, 0);
  EXPECT_LT(shared4, own4.bubble_s);
  w.rates.concurrent = false;  // one rank measured alone: its rate is its core's
  EXPECT_NEAR(price(pp2, f, c, w).bubble_s, own.bubble_s, 1e-12);
}

// The runs' steps fit a compute factor and one communication factor: exact where the runs' steps are
// a x compute + b x communication; one factor for both from a single run, or where two would not both be
// above 0.
TEST(SuggestRates, RunsFitTheirStepsWithAComputeAndACommunicationFactor) {
  MachineRates r = given_rates();
  // predicted compute, latency, bytes; measured compute and communication (only their sum is fitted)
  r.runs.push_back({"a", 1.0, 0.15, 0.05, 1.0, 2.0 * 1.0 + 0.5 * 0.2 - 1.0});
  r.refit();
  EXPECT_DOUBLE_EQ(r.compute_fit, 2.1 / 1.2);
  EXPECT_DOUBLE_EQ(r.latency_fit, r.compute_fit);
  r.runs.push_back({"b", 0.2, 0.5, 0.3, 0.1, 2.0 * 0.2 + 0.5 * 0.8 - 0.1});
  r.runs.push_back({"c", 0.6, 0.1, 0.1, 0.3, 2.0 * 0.6 + 0.5 * 0.2 - 0.3});
  r.refit();
  EXPECT_NEAR(r.compute_fit, 2.0, 1e-9);
  EXPECT_NEAR(r.latency_fit, 0.5, 1e-9);
  EXPECT_DOUBLE_EQ(r.bandwidth_fit, r.latency_fit);
  EXPECT_EQ(r.runs_fitted, 3);
  // two runs of one mix: no second factor to tell apart
  MachineRates same = given_rates();
  same.runs.push_back({"a", 1.0, 0.5, 0.5, 1.0, 1.0});
  same.runs.push_back({"b", 2.0, 1.0, 1.0, 2.5, 2.5});
  same.refit();
  EXPECT_DOUBLE_EQ(same.compute_fit, same.latency_fit);
  EXPECT_NEAR(same.compute_fit, 7.0 / 6.0, 1e-12);
}

TEST(SuggestRates, SurviveTheirJson) {
  MachineRates r = given_rates();
  r.shapes[{128, 64, 32}] = 12.5e9;
  r.runs.push_back({"a", 1.0, 0.15, 0.05, 1.0, 2.0 * 1.0 + 0.5 * 0.2 - 1.0});
  r.runs.push_back({"b", 0.2, 0.5, 0.3, 0.1, 2.0 * 0.2 + 0.5 * 0.8 - 0.1});
  r.refit();
  const MachineRates back = rates_from_json(to_json(r), "x.json");
  EXPECT_EQ(back.matmul_flops, r.matmul_flops);
  EXPECT_EQ(back.intra_by_size.at(2).latency_s, 1e-3);
  EXPECT_EQ(back.shapes.at({128, 64, 32}), 12.5e9);
  EXPECT_NEAR(back.compute_fit, 2.0, 1e-9);
  EXPECT_NEAR(back.latency_fit, 0.5, 1e-9);
  EXPECT_EQ(back.runs_fitted, 2);
  EXPECT_EQ(back.link(2, true).bytes_per_s, 0.6e9);
  EXPECT_EQ(back.link(2, false).bytes_per_s, 0.25e9);
  EXPECT_THROW(rates_from_json(nlohmann::json::object(), "x.json"), UserError);
}

TEST(SuggestRates, KeepWhatTheyMeasuredOnFirstUse) {
  MachineRates r = given_rates();
  int made = 0;
  auto pass = [&made](int64_t elements) {
    ++made;
    auto t = std::make_shared<torch::Tensor>(torch::zeros({elements}));
    return std::function<void()>([t] { t->add_(1); });
  };
  EXPECT_EQ(r.per_element_s("sgd step", pass), 0);  // given rates measure nothing
  EXPECT_EQ(made, 0);
  EXPECT_EQ(r.comm_core_s(), 0);
  r.measure = true, r.ranks = 1;
  const double s = r.per_element_s("sgd step", pass);
  EXPECT_GT(s, 0);
  EXPECT_TRUE(r.dirty);
  const int once = made;
  EXPECT_EQ(r.per_element_s("sgd step", pass), s);  // cached: not measured again
  EXPECT_EQ(made, once);
  r.cores = 2, r.ranks = 2;  // as many cores as ranks: a collective takes no core from a computing rank
  EXPECT_EQ(r.comm_core_s(), 0);
  r.comm_core_s_per_byte = 2e-9;
  const MachineRates back = rates_from_json(to_json(r), "x.json");
  EXPECT_EQ(back.per_element.at("sgd step"), s);
  EXPECT_EQ(back.comm_core_s_per_byte, 2e-9);
  EXPECT_EQ(rates_from_json(to_json(given_rates()), "x.json").comm_core_s_per_byte, -1);  // unmeasured stays so
}

// The collectives Gloo runs itself (an all-to-all, an all-reduce) are measured for their group on first
// use (two ranks' threads over a real Gloo group here), each kind apart, and kept; given rates, a group
// across nodes or one that does not divide the node's ranks take the rings' figures.
TEST(SuggestRates, MeasureGloosOwnCollectivesOnFirstUse) {
  const auto a2a = MachineRates::Collective::kAllToAll, reduce = MachineRates::Collective::kAllReduce;
  MachineRates r = given_rates();
  EXPECT_EQ(r.native(a2a, 2, true).latency_s, r.link(2, true).latency_s);  // given rates measure nothing
  r.measure = true, r.ranks = 2;
  EXPECT_EQ(r.native(a2a, 2, false).latency_s, r.link(2, false).latency_s);
  EXPECT_EQ(r.native(a2a, 4, true).latency_s, r.link(4, true).latency_s);  // 4 does not divide 2 ranks
  EXPECT_TRUE(r.exchange_by_size.empty());
  EXPECT_GT(r.native(a2a, 2, true).bytes_per_s, 0);
  EXPECT_TRUE(r.dirty);
  ASSERT_EQ(r.exchange_by_size.count(2), 1u);
  EXPECT_TRUE(r.reduce_by_size.empty());  // each kind apart
  EXPECT_GT(r.native(reduce, 2, true).bytes_per_s, 0);
  ASSERT_EQ(r.reduce_by_size.count(2), 1u);
  r.exchange_by_size[2] = {3e-3, 1e9}, r.reduce_by_size[2] = {4e-3, 2e9};  // kept, not measured again
  EXPECT_EQ(r.native(a2a, 2, true).latency_s, 3e-3);
  EXPECT_EQ(r.native(reduce, 2, true).latency_s, 4e-3);
  const MachineRates back = rates_from_json(to_json(r), "x.json");
  EXPECT_EQ(back.exchange_by_size.at(2).bytes_per_s, 1e9);
  EXPECT_EQ(back.reduce_by_size.at(2).bytes_per_s, 2e9);
}

// Where ranks share the cores, data parallelism's bytes take core time from the compute; on cores of
// their own (or a GPU) they take none.
TEST(SuggestCost, DataParallelBytesTakeCoreTimeOnSharedCores) {
  const ExperimentConfig c = parse_config(kMoe, "x.yaml");
  const ModelFacts f = facts_of(c);
  World w = world4();
  w.rates.comm_core_s_per_byte = 1e-9;
  Shape dp4;
  dp4.dp = 4, dp4.dp_mode = DpMode::kReplicate;
  const StepTerms own = price(dp4, f, c, w);
  EXPECT_GT(own.dp_bytes, 0);
  EXPECT_EQ(own.comm_core_s, 0);  // cores not known: a core a rank
  w.rates.cores = 2, w.rates.ranks = 4, w.rates.threads = 1;
  const StepTerms shared = price(dp4, f, c, w);
  EXPECT_DOUBLE_EQ(shared.dp_bytes, own.dp_bytes);
  EXPECT_NEAR(shared.comm_core_s, 1e-9 * own.dp_bytes, 1e-15);
  EXPECT_NEAR(shared.compute_s() - own.compute_s(), shared.comm_core_s, 1e-12);
  // the bytes a replicated rank sends: the all-reduce's 2 (g - 1) / g of its parameters
  EXPECT_NEAR(own.dp_bytes, 2.0 * 3 / 4 * f.param_bytes, 1e-6 * f.param_bytes);
}

// expert_parallel over the data-parallel dim is a group of those ranks, as over a dim of its own: inside
// the node where they fit, at the intra-node link (an across-nodes price would double its latency here).
TEST(SuggestCost, ExpertParallelOverTheDataParallelDimStaysInItsNode) {
  const ExperimentConfig c = parse_config(kMoe, "x.yaml");
  const ModelFacts f = facts_of(c);
  World w = world4();
  Shape own, borrowed;
  own.ep = 4;
  borrowed.ep = 4, borrowed.dp = 4, borrowed.dp_mode = DpMode::kFullyShard, borrowed.ep_borrows_dp = true;
  const StepTerms a = price(own, f, c, w), b = price(borrowed, f, c, w);
  ASSERT_GT(a.ep_s, 0);
  EXPECT_DOUBLE_EQ(b.ep_s, a.ep_s);
  w.ranks_per_node = 2;  // now 4 ranks span two nodes either way
  EXPECT_GT(price(borrowed, f, c, w).ep_s, b.ep_s);
}

// replicate all-reduces each 25 MB bucket as soon as the last microbatch's backward has written it: the
// buckets before the last run while backward goes on. A model of one bucket waits for all of it, and so
// does a pipeline (it all-reduces after its last microbatch).
TEST(SuggestCost, ReplicateHidesItsBucketsBehindTheLastBackward) {
  // kMoe's experts grown to the experts benchmark's (configs/bench/suggest_moe_experts.yaml): 80 MB
  std::string text = kMoe;
  const std::string small_args = text.substr(text.find("{dim"), text.find('}') - text.find("{dim") + 1);
  text.replace(text.find(small_args), small_args.size(),
               "{dim: 256, n_layers: 2, n_heads: 8, n_kv_heads: 4, vocab_size: 1024, multiple_of: 64, max_seq_len: 64, "
               "n_experts: 16, top_k: 2, n_shared_experts: 0, moe_hidden_dim: 768}");
  const ExperimentConfig big = parse_config(text, "x.yaml");
  const ModelFacts f = facts_of(big);
  ASSERT_GT(f.param_bytes, 3 * 25.0 * 1024 * 1024);  // four buckets
  World w = world4();
  Shape dp4;
  dp4.dp = 4, dp4.dp_mode = DpMode::kReplicate;
  const StepTerms t = price(dp4, f, big, w);
  EXPECT_GT(t.hidden_s, 0);
  EXPECT_LT(t.hidden_s, t.dp_s);
  EXPECT_NEAR(t.raw_comm_s(), t.dp_s - t.hidden_s + t.stats_s, 1e-12);
  Shape accumulated = dp4;  // the last of 4 microbatches' backward: a quarter as long to hide behind
  accumulated.microbatches = 4;
  EXPECT_LT(price(accumulated, f, big, w).hidden_s, t.hidden_s);
  Shape piped;
  piped.pp = 2, piped.dp = 2, piped.dp_mode = DpMode::kReplicate, piped.microbatches = 2;
  EXPECT_EQ(price(piped, f, big, w).hidden_s, 0);
  const ExperimentConfig small = parse_config(kMoe, "x.yaml");
  const ModelFacts g = facts_of(small);
  ASSERT_LT(g.param_bytes, 25.0 * 1024 * 1024);
  EXPECT_NEAR(price(dp4, g, small, w).hidden_s, 0, 1e-15);
}

// fully_shard issues each unit's all-gather but a pass's first while the unit before it computes. On cpu
// only their waiting hides (their copies need the busy cores): the hidden time follows the latency and
// not the bandwidth.
TEST(SuggestCost, FullyShardsPrefetchedGathersHideTheirLatencyOnCpu) {
  const ExperimentConfig c = parse_config(kMoe, "x.yaml");
  const ModelFacts f = facts_of(c);
  World w = world4();
  w.rates.matmul_flops = 1e8;  // compute long enough to hide them all
  Shape fsdp;
  fsdp.dp = 4, fsdp.dp_mode = DpMode::kFullyShard;
  const StepTerms t = price(fsdp, f, c, w);
  ASSERT_GT(t.matmul_s, 2 * t.hidden_s);
  const double units = f.layers + 2.0, passes = 2;  // the layers, the embedding, the output; forward and backward
  EXPECT_NEAR(t.hidden_s, (units - 1) * passes * w.rates.link(4, true).latency_s, 1e-12);
  w.rates.intra_by_size[4].bytes_per_s /= 2;
  EXPECT_NEAR(price(fsdp, f, c, w).hidden_s, t.hidden_s, 1e-12);
  w.rates.intra_by_size[4].latency_s *= 2;
  EXPECT_NEAR(price(fsdp, f, c, w).hidden_s, 2 * t.hidden_s, 1e-12);
}

TEST(SuggestExplain, NamesTheTermThatDecides) {
  Candidate a, b;
  a.name = "a", b.name = "b";
  a.terms.matmul_s = b.terms.matmul_s = 1.0;
  b.terms.tp_s = 0.25;
  const std::string why = explain_choice(a, b);
  EXPECT_NE(why.find("250.0 ms a step cheaper"), std::string::npos) << why;
  EXPECT_NE(why.find("tensor-parallel communication -250.0 ms"), std::string::npos) << why;
  EXPECT_EQ(why.find("matmul"), std::string::npos) << why;
}

}  // namespace
}  // namespace composer
