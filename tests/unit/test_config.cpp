// Config parsing: defaults, strictness, error positions, overrides, hashing.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "models/registry.h"
#include "runner/config/config.h"
#include "runner/plan/planner.h"

namespace composer {
namespace {

const char kMinimal[] = "name: t\nmodel: {name: mlp_module}\n";

std::string error_of(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  try {
    parse_config(yaml, "x.yaml", sets);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Config, MinimalConfigGetsDefaults) {
  auto c = parse_config(kMinimal, "x.yaml");
  EXPECT_EQ(c.name, "t");
  EXPECT_EQ(c.model.args.i("dim"), 10);
  EXPECT_EQ(c.train.steps, 10);
  EXPECT_EQ(c.train.optimizer.name, OptimizerKind::kAdam);
  EXPECT_EQ(c.mesh.world_size(), 1);
  EXPECT_EQ(golden_path(c), "tests/golden/t.json");
}

TEST(Config, UnknownKeyNamesLineColumnPathAndSuggestion) {
  std::string e = error_of("name: t\nmodel: {name: mlp_module}\ntrain:\n  stepz: 3\n");
  EXPECT_EQ(e, "x.yaml:4:3: train.stepz: unknown key; did you mean steps?");
}

TEST(Config, UnknownTopLevelSection) {
  EXPECT_NE(error_of("name: t\nmodel: {name: mlp_module}\ntrian: {}\n").find("x.yaml:3:1: trian: unknown key; did you mean train?"),
            std::string::npos);
}

TEST(Config, WrongTypeNamesExpectedType) {
  std::string e = error_of("name: t\nmodel: {name: mlp_module}\ntrain: {steps: many}\n");
  EXPECT_NE(e.find("x.yaml:3:16: train.steps: expected an integer, got 'many'"), std::string::npos) << e;
}

TEST(Config, OutOfRangeValue) {
  std::string e = error_of("name: t\nmodel: {name: mlp_module}\ntrain: {steps: 0}\n");
  EXPECT_NE(e.find("train.steps: steps must be positive, got 0"), std::string::npos) << e;
}

TEST(Config, MalformedYamlHasPosition) {
  std::string e = error_of("name: t\nmodel: {name: mlp_module\ntrain: [\n");
  EXPECT_NE(e.find("x.yaml:"), std::string::npos);
  EXPECT_NE(e.find("malformed YAML"), std::string::npos) << e;
}

TEST(Config, MissingFileIsAFileError) {
  EXPECT_THROW(load_config("/nonexistent/config.yaml"), FileError);
}

TEST(Config, UnknownModelSuggestsNearest) {
  std::string e = error_of("name: t\nmodel: {name: transfomer}\n");
  EXPECT_NE(e.find("unknown model 'transfomer'; did you mean transformer?"), std::string::npos) << e;
}

TEST(Config, UnknownModelArgument) {
  std::string e = error_of("name: t\nmodel: {name: transformer, args: {n_head: 4}}\n");
  EXPECT_NE(e.find("model.args.n_head: unknown key; did you mean n_heads?"), std::string::npos) << e;
}

TEST(Config, ModelArgumentCheckPointsAtTheArgument) {
  std::string e = error_of("name: t\nmodel:\n  name: transformer\n  args: {dim: 16, n_heads: 3}\n");
  EXPECT_NE(e.find("x.yaml:4:28: model.args.n_heads: n_heads 3 does not divide dim 16"), std::string::npos) << e;
}

TEST(Config, EnumValueListsValidValues) {
  std::string e = error_of("name: t\nmodel: {name: mlp_module}\ntrain: {optimizer: {name: lamb}}\n");
  EXPECT_NE(e.find("unknown value 'lamb'; valid values: sgd, adam, adamw"), std::string::npos) << e;
}

TEST(Config, SetOverridesUseYamlPaths) {
  auto c = parse_config(kMinimal, "x.yaml", {"train.steps=3", "model.args.dim=4", "train.optimizer.betas=[0.5, 0.6]"});
  EXPECT_EQ(c.train.steps, 3);
  EXPECT_EQ(c.model.args.i("dim"), 4);
  EXPECT_DOUBLE_EQ(c.train.optimizer.betas[1], 0.6);
}

TEST(Config, SetErrorsPointAtTheOverride) {
  std::string e = error_of(kMinimal, {"train.steps=-1"});
  EXPECT_NE(e.find("--set train.steps=-1: train.steps: steps must be positive"), std::string::npos) << e;
  e = error_of(kMinimal, {"train.stpes=4"});
  EXPECT_NE(e.find("--set train.stpes=4: train.stpes: unknown key; did you mean steps?"), std::string::npos) << e;
  EXPECT_NE(error_of(kMinimal, {"train.steps"}).find("expected path=value"), std::string::npos);
}

TEST(Config, DuplicateKeysNameBothPlaces) {
  EXPECT_EQ(error_of("name: a\nmodel: {name: mlp_module}\nname: b\n"),
            "x.yaml:3:1: name: duplicate key 'name', first given at line 1, column 1; keep one of them");
  // Nested, in flow style, and inside a sequence entry.
  std::string e = error_of("name: t\nmodel: {name: mlp_module}\ntrain: {steps: 2, steps: 3}\n");
  EXPECT_NE(e.find("x.yaml:3:19: train.steps: duplicate key 'steps', first given at line 3, column 9; keep one"),
            std::string::npos)
      << e;
  e = error_of("name: t\nmodel: {name: mlp_module}\nmesh: {shape: [2], names: [dp]}\nparallelize:\n"
               "  - replicate:\n      mesh_dim: dp\n      mesh_dim: dp\n");
  EXPECT_NE(e.find("x.yaml:7:7: parallelize[0].replicate.mesh_dim: duplicate key 'mesh_dim', first given at line 6, "
                   "column 7"),
            std::string::npos)
      << e;
  // Equal keys in different mappings are fine.
  EXPECT_EQ(error_of("name: t\nmodel: {name: mlp_module, args: {dim: 4}}\ntrain: {optimizer: {name: sgd}}\n"),
            "no error");
}

TEST(Config, DuplicateKeysInSetOverrides) {
  std::string e = error_of(kMinimal, {"train.steps=3", "train.steps=4"});
  EXPECT_EQ(e, "--set train.steps=4: train.steps is already set by --set train.steps=3; give each path once");
  e = error_of(kMinimal, {"train={steps: 3, steps: 4}"});
  EXPECT_NE(e.find("--set train={steps: 3, steps: 4}: train.steps: duplicate key 'steps', first given at column 2 of "
                   "the value"),
            std::string::npos)
      << e;
  EXPECT_EQ(error_of(kMinimal, {"train={steps: 3}", "train.log_every=1"}), "no error");
}

TEST(Config, ZbvDefaultsToTwoVirtualStages) {
  const std::string base = "name: t\nmodel: {name: mlp_module_layers}\nmesh: {shape: [2], names: [pp]}\n"
                           "train: {global_batch: 8}\nparallelize:\n  - pipeline: {mesh_dim: pp, schedule: ";
  auto c = parse_config(base + "zbv}\n", "x.yaml");
  EXPECT_EQ(std::get<PipelineConfig>(c.parallelize[0].options).virtual_stages, 2);
  EXPECT_NO_THROW(make_plan(c, 2));
  EXPECT_EQ(std::get<PipelineConfig>(parse_config(base + "1f1b}\n", "x.yaml").parallelize[0].options).virtual_stages, 1);
  // Given explicitly, it is what the user wrote (and zbv refuses anything but 2).
  auto three = parse_config(base + "zbv, virtual_stages: 3}\n", "x.yaml");
  EXPECT_THROW(make_plan(three, 2), PlanError);
}

TEST(Planner, WarnsWhenAPipelineScalesASummedLoss) {
  const std::string base = "name: t\nmodel: {name: mlp_module_layers}\nmesh: {shape: [2], names: [pp]}\n"
                           "parallelize:\n  - pipeline: {mesh_dim: pp, schedule: 1f1b";
  auto warned = make_plan(parse_config(base + "}\ntrain: {global_batch: 8, loss: {name: sum}}\n", "x.yaml"), 2);
  ASSERT_EQ(warned.warnings.size(), 1u);
  EXPECT_NE(warned.warnings[0].find("x.yaml:5:5: parallelize[0]: loss: sum with the pipeline's scale_grads: true "
                                    "divides each microbatch's gradient by the 2 microbatches"),
            std::string::npos) << warned.warnings[0];
  EXPECT_NE(warned.warnings[0].find("set scale_grads: false"), std::string::npos);
  EXPECT_TRUE(make_plan(parse_config(base + ", scale_grads: false}\ntrain: {global_batch: 8, loss: {name: sum}}\n",
                                     "x.yaml"), 2).warnings.empty());
  EXPECT_TRUE(make_plan(parse_config(base + "}\ntrain: {global_batch: 8, loss: {name: mse}}\n", "x.yaml"), 2)
                  .warnings.empty());
}

TEST(Config, ParallelizeEntriesAreParsedStrictly) {
  auto c = parse_config(std::string(kMinimal) +
                            "mesh: {shape: [2, 2], names: [dp, tp]}\n"
                            "parallelize:\n  - tensor_parallel: {}\n  - fully_shard: {units: ['layers.*'], "
                            "reshard_after_forward: false}\n",
                        "x.yaml");
  ASSERT_EQ(c.parallelize.size(), 2u);
  EXPECT_TRUE(std::holds_alternative<TensorParallelConfig>(c.parallelize[0].options));
  EXPECT_STREQ(c.parallelize[0].name(), "tensor_parallel");
  EXPECT_EQ(c.parallelize[0].mesh_dim(), std::vector<std::string>{"tp"});
  EXPECT_EQ(std::get<FullyShardConfig>(c.parallelize[1].options).reshard_after_forward.size, 1);  // false: kept gathered
  auto fs_of = [](const std::string& v) {
    auto c = parse_config(std::string(kMinimal) + "parallelize:\n  - fully_shard: {reshard_after_forward: " + v + "}\n",
                          "x.yaml");
    return std::get<FullyShardConfig>(c.parallelize[0].options).reshard_after_forward.size;
  };
  EXPECT_EQ(fs_of("true"), 0);  // the whole shard group
  EXPECT_EQ(fs_of("2"), 2);
  for (const char* bad : {"0", "-2", "sometimes", "[2]", "1.5"}) {
    std::string e = error_of(std::string(kMinimal) + "parallelize:\n  - fully_shard: {reshard_after_forward: " + bad +
                             "}\n");
    EXPECT_NE(e.find("reshard_after_forward is true, false or a group size N >= 1"), std::string::npos) << bad << e;
  }
  std::string e = error_of(std::string(kMinimal) + "parallelize:\n  - fully_shard: {reshard_after_forwrd: false}\n");
  EXPECT_NE(e.find("x.yaml:4:19: parallelize[0].fully_shard.reshard_after_forwrd: unknown key; did you mean "
                   "reshard_after_forward?"),
            std::string::npos)
      << e;
  e = error_of(std::string(kMinimal) + "parallelize:\n  - fsdp: {}\n");
  EXPECT_NE(e.find("unknown transform 'fsdp'"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "parallelize:\n  - pipeline: {schedule: zb}\n");
  EXPECT_NE(e.find("valid values: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv"),
            std::string::npos)
      << e;
}

TEST(Config, MicrobatchesMustDivideTheBatch) {
  std::string e = error_of(std::string(kMinimal) + "train: {global_batch: 6, microbatches: 4}\n");
  EXPECT_NE(e.find("microbatches 4 does not divide global_batch 6"), std::string::npos) << e;
}

TEST(Config, FileDataNeedsAPath) {
  EXPECT_NE(error_of(std::string(kMinimal) + "data: {source: file}\n").find("needs data.path"), std::string::npos);
}

TEST(Config, HashIgnoresParallelismAndLogging) {
  auto a = parse_config(kMinimal, "x.yaml");
  auto b = parse_config(std::string(kMinimal) + "mesh: {shape: [2], names: [dp]}\ncheck: {loss_rtol: 0.1}\n",
                        "y.yaml", {"train.log_every=3"});
  auto c = parse_config(kMinimal, "x.yaml", {"train.optimizer.lr=0.5"});
  EXPECT_EQ(config_hash(a), config_hash(b));
  EXPECT_NE(config_hash(a), config_hash(c));
}

TEST(Config, InjectedFaultsKeepTheGoldenHash) {
  // A run with debug.inject is checked against the right run's golden, so the hash ignores it.
  auto a = parse_config(kMinimal, "x.yaml");
  auto b = parse_config(kMinimal, "x.yaml", {"debug.inject=grad_x2"});
  EXPECT_EQ(a.debug.inject, Inject::kNone);
  EXPECT_EQ(b.debug.inject, Inject::kGradX2);
  EXPECT_EQ(parse_config(kMinimal, "x.yaml", {"debug.inject=microbatch_off_by_one"}).debug.inject,
            Inject::kMicrobatchOffByOne);
  EXPECT_EQ(config_hash(a), config_hash(b));
  EXPECT_NE(error_of(kMinimal, {"debug.inject=grad_x3"}).find("debug.inject"), std::string::npos);
}
TEST(Planner, MeshProductMustEqualWorldSize) {
  auto c = parse_config(std::string(kMinimal) + "mesh: {shape: [2, 3], names: [dp, tp]}\n", "x.yaml");
  try {
    make_plan(c, 4);
    FAIL() << "expected a PlanError";
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("mesh.shape [2, 3] has 6 ranks but the job has 4"), std::string::npos)
        << e.what();
  }
}

TEST(Planner, TransformMeshDimMustExist) {
  auto c = parse_config(std::string(kMinimal) + "mesh: {shape: [2], names: [dp]}\nparallelize:\n  - replicate: {mesh_dim: ddp}\n",
                        "x.yaml");
  try {
    make_plan(c, 2);
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("x.yaml:5:5: parallelize[0]: replicate uses mesh dim 'ddp' but mesh.names is [dp]"),
              std::string::npos)
        << e.what();
  }
}

TEST(Planner, TransformOrderIsEnforced) {
  auto c = parse_config(std::string(kMinimal) +
                            "mesh: {shape: [1, 1], names: [dp, tp]}\nparallelize:\n  - fully_shard: {}\n  - tensor_parallel: {}\n",
                        "x.yaml");
  try {
    make_plan(c, 1);
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor_parallel comes after fully_shard"), std::string::npos) << e.what();
  }
}

TEST(Planner, SingleDevicePlan) {
  auto p = make_plan(parse_config(kMinimal, "x.yaml"), 1);
  EXPECT_EQ(p.world_size, 1);
  EXPECT_EQ(p.dp_size, 1);
  EXPECT_EQ(p.local_batch, 8);
  EXPECT_FALSE(p.summary.empty());
}

std::string plan_error(const std::string& yaml, int64_t world) {
  try {
    make_plan(parse_config(yaml, "x.yaml"), world);
  } catch (const PlanError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Planner, ReplicateSplitsTheGlobalBatch) {
  auto p = make_plan(parse_config(std::string(kMinimal) +
                                      "mesh: {shape: [2, 2], names: [a, b]}\nparallelize:\n  - replicate: {mesh_dim: [a, b]}\n"
                                      "train: {global_batch: 16, microbatches: 2}\n",
                                  "x.yaml"),
                     4);
  EXPECT_EQ(p.dp_size, 4);
  EXPECT_EQ(p.local_batch, 4);
  EXPECT_EQ(p.local_microbatch, 2);
  ASSERT_EQ(p.flat_groups.size(), 1u);
  EXPECT_EQ(p.flat_groups[0], (std::vector<std::string>{"a", "b"}));
}

TEST(Planner, GlobalBatchMustSplitOverDataParallelRanks) {
  std::string e = plan_error(std::string(kMinimal) + "mesh: {shape: [3], names: [dp]}\nparallelize:\n  - replicate: {}\n", 3);
  EXPECT_NE(e.find("train.global_batch: global_batch 8 does not split over 3 data-parallel ranks x 1 microbatches (3); "
                   "use a multiple of 3"),
            std::string::npos)
      << e;
}

TEST(Planner, EveryMeshDimNeedsATransform) {
  std::string e = plan_error(std::string(kMinimal) + "mesh: {shape: [2], names: [dp]}\n", 2);
  EXPECT_NE(e.find("mesh dim 'dp' has 2 ranks but no transform uses it"), std::string::npos) << e;
}

TEST(Planner, ADimServesOneTransform) {
  std::string e = plan_error(std::string(kMinimal) +
                                 "mesh: {shape: [2], names: [dp]}\nparallelize:\n  - replicate: {}\n  - replicate: {}\n",
                             2);
  EXPECT_NE(e.find("mesh dim 'dp' is already used"), std::string::npos) << e;
}

TEST(Planner, ActivationCheckpointingNamesItsUnits) {
  const std::string t = "name: t\nmodel: {name: transformer, args: {n_layers: 4}}\n";
  auto p = make_plan(parse_config(t + "parallelize:\n  - activation_checkpointing: {units: [layers], every: 2}\n",
                                  "x.yaml"),
                     1);
  EXPECT_EQ(p.summary.back(),
            "activation_checkpointing: 2 units recompute their forward in backward (layers.1, layers.3)");
  const std::string no_units =
      error_of("name: t\nmodel: {name: mlp_module}\nparallelize:\n  - activation_checkpointing: {}\n");
  EXPECT_NE(no_units.find("x.yaml:4:"), std::string::npos) << no_units;
  EXPECT_NE(no_units.find("parallelize[0].activation_checkpointing: activation_checkpointing needs units"),
            std::string::npos)
      << no_units;
  std::string e = plan_error(t + "parallelize:\n  - activation_checkpointing: {units: ['layers.*.nope']}\n", 1);
  EXPECT_NE(e.find("x.yaml:4:5: parallelize[0]: layers.*.nope: unit pattern matches no module of Transformer"),
            std::string::npos)
      << e;
}

TEST(Planner, NoFullyShardUnitInsideACheckpointedUnit) {
  std::string e = plan_error("name: t\nmodel: {name: transformer}\nmesh: {shape: [2], names: [dp]}\n"
                             "parallelize:\n  - activation_checkpointing: {units: ['layers.*']}\n"
                             "  - fully_shard: {units: ['layers.*.attention']}\n",
                             2);
  EXPECT_NE(e.find("x.yaml:6:5: parallelize[1]: fully_shard unit layers.0.attention lies inside the checkpointed "
                   "unit layers.0"),
            std::string::npos)
      << e;
  auto p = make_plan(parse_config("name: t\nmodel: {name: transformer}\nmesh: {shape: [2], names: [dp]}\n"
                                  "parallelize:\n  - activation_checkpointing: {units: ['layers.*.attention']}\n"
                                  "  - fully_shard: {units: ['layers.*']}\n",
                                  "x.yaml"),
                     2);
  EXPECT_EQ(p.dp_size, 2);
}

TEST(Planner, TensorParallelNeedsDividedHeads) {
  std::string e = plan_error("name: t\nmodel: {name: transformer}\nmesh: {shape: [3], names: [tp]}\n"
                             "parallelize:\n  - tensor_parallel: {}\n",
                             3);
  EXPECT_NE(e.find("parallelize[0]: tp degree 3 does not divide n_heads 4 (model.args.n_heads); use a tp that divides it"),
            std::string::npos)
      << e;
}

TEST(Planner, TensorParallelNeedsAPlan) {
  std::string e = plan_error("name: t\nmodel: {name: unit_module}\nmesh: {shape: [2], names: [tp]}\n"
                             "parallelize:\n  - tensor_parallel: {}\n",
                             2);
  EXPECT_NE(e.find("model unit_module has no tensor-parallel plan; models with one: " +
                   models::listed_names_with(models::Capability::kTpPlan) + "; or give plan: custom with styles"),
            std::string::npos)
      << e;
}

TEST(Planner, SequenceParallelNeedsDividedSequence) {
  std::string e = plan_error("name: t\nmodel: {name: transformer}\nmesh: {shape: [2], names: [tp]}\n"
                             "parallelize:\n  - tensor_parallel: {sequence_parallel: true}\ndata: {seq_len: 7}\n",
                             2);
  EXPECT_NE(e.find("tp degree 2 does not divide seq_len 7"), std::string::npos) << e;
  e = plan_error("name: t\nmodel: {name: mlp_stack}\nmesh: {shape: [2], names: [tp]}\n"
                 "parallelize:\n  - tensor_parallel: {sequence_parallel: true}\n",
                 2);
  EXPECT_NE(e.find("model mlp_stack has no sequence-parallel plan"), std::string::npos) << e;
}

TEST(Planner, TensorParallelPlanIsTheModels) {
  auto p = make_plan(parse_config("name: t\nmodel: {name: mlp_module}\nmesh: {shape: [2], names: [tp]}\n"
                                  "parallelize:\n  - tensor_parallel: {}\n",
                                  "x.yaml"),
                     2);
  const TensorParallelConfig* tp = p.find<TensorParallelConfig>();
  ASSERT_NE(tp, nullptr);
  ASSERT_EQ(tp->rules.size(), 2u);
  EXPECT_EQ(tp->rules[0].pattern, "net1");
  EXPECT_EQ(p.dp_size, 1);
}

TEST(Config, DebugDelayIsOneEntryOrAList) {
  const std::string mesh = "mesh: {shape: [2], names: [dp]}\nparallelize: [{replicate: {}}]\n";
  auto one = parse_config(std::string(kMinimal) + mesh + "debug: {delay: {point: before_free, ms: 250, ranks: [1]}}\n",
                          "x.yaml");
  ASSERT_EQ(one.debug.delay.size(), 1u);
  EXPECT_EQ(one.debug.delay[0].point, parallel::DelayPoint::kBeforeFree);
  EXPECT_EQ(one.debug.delay[0].ms, 250);
  EXPECT_EQ(one.debug.delay[0].ranks, std::vector<int64_t>{1});
  auto list = parse_config(std::string(kMinimal) + mesh +
                               "debug:\n  delay:\n    - {point: after_loss, ms: 5}\n"
                               "    - {point: before_reduce_scatter, ms: 7, ranks: [0, 1]}\n",
                           "x.yaml");
  ASSERT_EQ(list.debug.delay.size(), 2u);
  EXPECT_EQ(list.debug.delay[0].point, parallel::DelayPoint::kAfterLoss);
  EXPECT_TRUE(list.debug.delay[0].ranks.empty());  // every rank
  EXPECT_EQ(list.debug.delay[1].point, parallel::DelayPoint::kBeforeReduceScatter);
  EXPECT_EQ(to_json(list)["debug"]["delay"][1]["point"], "before_reduce_scatter");
  // Delays never change what a run computes: the golden hash ignores them.
  EXPECT_EQ(config_hash(one), config_hash(parse_config(std::string(kMinimal) + mesh, "x.yaml")));
  EXPECT_NE(error_of(std::string(kMinimal) + "debug: {delay: {point: after_loss}}\n").find("missing required key 'ms'"),
            std::string::npos);
  EXPECT_NE(error_of(std::string(kMinimal) + "debug: {delay: {point: after_loss, ms: 0}}\n").find("ms"),
            std::string::npos);
  EXPECT_NE(
      error_of(std::string(kMinimal) + "debug: {delay: {point: after_loss, ms: 3, rank: [0]}}\n").find("unknown key"),
      std::string::npos);
}

TEST(Delays, SleepOnlyOnTheirRanksAndCountTheSleeps) {
  std::vector<parallel::Delay> d{{parallel::DelayPoint::kBeforeFree, 1, {1}},
                                 {parallel::DelayPoint::kAfterLoss, 2, {}}};
  parallel::Delays rank0(d, 0), rank1(d, 1);
  rank0.at(parallel::DelayPoint::kBeforeFree);
  rank0.at(parallel::DelayPoint::kAfterLoss);
  rank1.at(parallel::DelayPoint::kBeforeFree);
  rank1.at(parallel::DelayPoint::kBeforeSend);
  EXPECT_EQ(rank0.slept(), 1);
  EXPECT_EQ(rank0.slept_ms(), 2);
  EXPECT_EQ(rank1.slept(), 1);
  EXPECT_EQ(rank1.slept_ms(), 1);
  EXPECT_TRUE(parallel::Delays({}, 0).empty());
}

TEST(Planner, APipelineComesFirst) {
  // The pipeline cuts the model into stages; every other transform applies to
  // each stage, so the YAML lists it first.
  auto c = parse_config("name: t\nmodel: {name: mlp_module_layers}\nmesh: {shape: [2, 2], names: [pp, tp]}\n"
                        "train: {global_batch: 8}\nparallelize:\n  - tensor_parallel: {mesh_dim: tp}\n"
                        "  - pipeline: {mesh_dim: pp, schedule: gpipe}\n",
                        "x.yaml");
  try {
    make_plan(c, 4);
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("x.yaml:7:5: parallelize[1]: pipeline comes after tensor_parallel; transforms "
                                         "apply in the order parallelize lists them, which must be pipeline"),
              std::string::npos)
        << e.what();
  }
}

TEST(Planner, LeavesTheRandomStateAlone) {
  // Planning builds the model shape-only, once: no value is drawn, so a
  // run's initial values do not depend on whether it was planned first.
  const char* plans[] = {
      "mesh: {shape: [2, 2, 2], names: [pp, dp, tp]}\ntrain: {global_batch: 16}\nparallelize:\n"
      "  - pipeline: {mesh_dim: pp, schedule: 1f1b}\n  - tensor_parallel: {mesh_dim: tp}\n"
      "  - fully_shard: {mesh_dim: dp, units: ['layers.*']}\n",
      "mesh: {shape: [2], names: [dp]}\ntrain: {global_batch: 8}\nparallelize:\n"
      "  - fully_shard: {mesh_dim: dp, per_rank: [layers.0], per_rank_seed: 5}\n"};
  for (const char* plan : plans) {
    auto c = parse_config(std::string("name: t\nseed: 3\nmodel: {name: mlp_module_layers}\n") + plan, "x.yaml");
    torch::manual_seed(123);
    const torch::Tensor before = at::detail::getDefaultCPUGenerator().get_state();
    make_plan(c, c.mesh.world_size());
    EXPECT_TRUE(before.equal(at::detail::getDefaultCPUGenerator().get_state())) << plan;
  }
}

// The transforms' key table in docs/configuration.md: each `# - KIND: {key:
// default, ...}` line (continued on the comment lines below it until its
// braces close), read as YAML.
std::map<std::string, YAML::Node> documented_transforms() {
  std::ifstream in("docs/configuration.md");
  EXPECT_TRUE(in.good()) << "docs/configuration.md not found from " << std::getenv("PWD");
  std::map<std::string, YAML::Node> out;
  std::string line, text;
  int depth = -1;  // -1: outside an entry
  while (std::getline(in, line)) {
    const size_t hash = line.find('#');
    if (hash == std::string::npos) continue;
    std::string rest = line.substr(hash + 1);
    if (depth < 0) {
      if (rest.rfind(" - ", 0) != 0 || rest.find(": {") == std::string::npos) continue;
      text.clear();
      depth = 0;
      rest = rest.substr(3);
    }
    for (char ch : rest) {
      text += ch;
      if (ch == '{') ++depth;
      if (ch == '}' && --depth == 0) break;
    }
    if (depth > 0) {
      text += ' ';
      continue;
    }
    const YAML::Node n = YAML::Load(text);
    out[n.begin()->first.as<std::string>()] = n.begin()->second;
    depth = -1;
  }
  return out;
}

// One spelling of a default for both sides: a one-element list as its element,
// numbers by value, booleans and strings as written.
std::string canonical(const nlohmann::json& j) {
  if (j.is_array()) {
    if (j.size() == 1) return canonical(j[0]);
    std::string s = "[";
    for (const auto& e : j) s += canonical(e) + ",";
    return s + "]";
  }
  if (j.is_boolean()) return j.get<bool>() ? "true" : "false";
  if (j.is_number()) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", j.get<double>());
    return buf;
  }
  return j.get<std::string>();
}

std::string canonical(const YAML::Node& n) {
  if (n.IsSequence()) {
    if (n.size() == 1) return canonical(n[0]);
    std::string s = "[";
    for (const auto& e : n) s += canonical(e) + ",";
    return s + "]";
  }
  const std::string v = n.Scalar();
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (!v.empty() && end && *end == 0) return canonical(nlohmann::json(d));
  return v;
}

TEST(Config, TheDocsKeyTableListsEveryTransformFieldWithItsDefault) {
  const auto documented = documented_transforms();
  std::set<std::string> kinds;
  for (const auto& t : default_transforms()) {
    const std::string kind = parallel::name_of(t);
    kinds.insert(kind);
    auto it = documented.find(kind);
    ASSERT_NE(it, documented.end()) << kind << " is missing from docs/configuration.md's parallelize keys";
    const nlohmann::json fields = to_json(t)[kind];
    std::set<std::string> keys;
    for (const auto& kv : it->second) keys.insert(kv.first.as<std::string>());
    for (const auto& [key, value] : fields.items()) {
      ASSERT_TRUE(keys.count(key)) << kind << "." << key << " is not in docs/configuration.md";
      EXPECT_EQ(canonical(it->second[key]), canonical(value)) << kind << "." << key << ": the docs give another default";
      keys.erase(key);
    }
    EXPECT_TRUE(keys.empty()) << kind << ": docs/configuration.md lists keys the code does not have: "
                              << (keys.empty() ? "" : *keys.begin());
  }
  for (const auto& [kind, n] : documented) EXPECT_TRUE(kinds.count(kind)) << kind << " is documented but not a transform";
}


// docs/configuration.md's "Every key, with its default" block, read as YAML:
// each key below a section (a mapping) by its dotted path.
void documented_keys(const YAML::Node& n, const std::string& prefix, std::map<std::string, YAML::Node>& out) {
  for (const auto& kv : n) {
    const std::string path = prefix + kv.first.as<std::string>();
    if (kv.second.IsMap() && kv.second.size() > 0) {
      documented_keys(kv.second, path + ".", out);
    } else {
      out[path] = kv.second;
    }
  }
}

std::map<std::string, YAML::Node> documented_sections() {
  std::ifstream in("docs/configuration.md");
  std::stringstream text;
  text << in.rdbuf();
  const std::string doc = text.str();
  const size_t begin = doc.find("```yaml\n", doc.find("## Every key, with its default")) + 8;
  std::map<std::string, YAML::Node> out;
  documented_keys(YAML::Load(doc.substr(begin, doc.find("```", begin) - begin)), "", out);
  return out;
}

TEST(Config, TheDocsKeyTableListsEverySectionFieldWithItsDefault) {
  // Keys the table shows another way, and why.
  const std::map<std::string, std::string> shown_otherwise = {
      {"data.documents.mask", "shown as true, the one value data.documents accepts"},
      {"data.documents.eos_id", "shown commented out: left out, each file's document index gives the ends"},
      {"data.token_dtype", "uint16 with source: tokens, absent with the others"},
      {"eval.data.source", "eval.data: {} names data's keys"},
      {"eval.data.path", "eval.data: {} names data's keys"},
      {"eval.data.token_dtype", "eval.data: {} names data's keys"},
      {"eval.data.sources", "eval.data: {} names data's keys"}};
  const auto documented = documented_sections();
  ExperimentConfig c;
  std::map<std::string, FieldLister::Entry> fields;
  FieldLister lister{fields, ""};
  c.fields(lister);
  std::set<std::string> keys;
  for (const auto& kv : documented) keys.insert(kv.first);
  keys.erase("eval.data");
  for (const auto& [path, entry] : fields) {
    if (shown_otherwise.count(path)) {
      keys.erase(path);
      continue;
    }
    auto it = documented.find(path);
    ASSERT_NE(it, documented.end()) << path << " is not in docs/configuration.md";
    keys.erase(path);
    if (entry.rules & kRequired) continue;  // the table shows an example
    const std::string want = entry.value.is_object() ? "{}" : canonical(entry.value);
    const std::string given = it->second.IsMap() ? "{}" : it->second.IsNull() ? "" : canonical(it->second);
    EXPECT_EQ(given, want) << path << ": the docs give another default";
  }
  EXPECT_TRUE(keys.empty()) << "docs/configuration.md lists keys the code does not have: "
                            << (keys.empty() ? "" : *keys.begin());
}

}  // namespace
}  // namespace composer
