// The checker of NCCL's point-to-point rules: hand-made sequences with known
// answers; every pipeline schedule the planner accepts, in the grouped order
// the runtime issues over NCCL; the order issued over Gloo, which must hang
// on NCCL; and the sequences recorded from dry runs of the context-parallel
// ring and of pipelines that carry cp or fully_shard.
#include <gtest/gtest.h>

#include <iostream>

#include "parallelisms/comm/p2p_check.h"
#include "parallelisms/pipeline/p2p_program.h"
#include "runner/config/config.h"
#include "runner/estimate/estimate.h"
#include "runner/plan/planner.h"

using namespace composer;
using namespace composer::parallel;

namespace {

P2PRecord send_to(int peer, int tag, int64_t bytes = 8) { return {true, peer, bytes, tag, "send " + std::to_string(tag)}; }
P2PRecord recv_from(int peer, int tag, int64_t bytes = 8) { return {false, peer, bytes, tag, "recv " + std::to_string(tag)}; }
P2PEvent issue(int group, std::vector<P2PRecord> ops) { return {P2PEvent::kIssue, "c", group, std::move(ops)}; }
P2PEvent wait(int group) { return {P2PEvent::kWait, "c", group, {}}; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(P2PCheck, AnExchangeIssuedAsOneGroupCompletes) {
  std::map<int, P2PLog> logs;
  logs[0] = {issue(0, {send_to(1, 1), recv_from(1, 2)}), wait(0)};
  logs[1] = {issue(0, {send_to(0, 2), recv_from(0, 1)}), wait(0)};
  const P2PCheck check = check_p2p(logs);
  EXPECT_TRUE(check.ok) << check.report;
  EXPECT_EQ(check.groups, 2);
  EXPECT_EQ(check.ops, 4);
}

TEST(P2PCheck, SendsIssuedAloneBeforeReceivesHang) {
  // Both ranks send first: each send waits for a receive queued behind the peer's own send.
  std::map<int, P2PLog> logs;
  logs[0] = {issue(0, {send_to(1, 1)}), issue(1, {recv_from(1, 2)}), wait(1)};
  logs[1] = {issue(0, {send_to(0, 2)}), issue(1, {recv_from(0, 1)}), wait(1)};
  const P2PCheck check = check_p2p(logs);
  EXPECT_FALSE(check.ok);
  EXPECT_TRUE(contains(check.report, "deadlock")) << check.report;
  EXPECT_TRUE(contains(check.report, "rank 0's send 1 to rank 1 waits for rank 1's recv 1 from rank 0, queued behind its group [send 2 to rank 0]"))
      << check.report;
}

TEST(P2PCheck, AReceivePostedAheadOfASendItNeedsHangs) {
  // The pipeline's case: rank 0 posts the gradient's receive before sending
  // the activation that rank 1 needs to compute that gradient.
  std::map<int, P2PLog> logs;
  logs[0] = {issue(0, {recv_from(1, 2)}), issue(1, {send_to(1, 1)}), wait(0), wait(1)};
  logs[1] = {issue(0, {recv_from(0, 1)}), wait(0), issue(1, {send_to(0, 2)}), wait(1)};
  const P2PCheck check = check_p2p(logs);
  EXPECT_FALSE(check.ok);
  EXPECT_TRUE(contains(check.report, "rank 0's recv 2 from rank 1 waits for rank 1's send 2 to rank 0, which that rank has not issued"))
      << check.report;
  EXPECT_TRUE(contains(check.report, "rank 1's recv 1 from rank 0 waits for rank 0's send 1 to rank 1, queued behind its group [recv 2 from rank 1]"))
      << check.report;
  // Sent first, then received: it completes.
  logs[0] = {issue(0, {send_to(1, 1)}), issue(1, {recv_from(1, 2)}), wait(0), wait(1)};
  EXPECT_TRUE(check_p2p(logs).ok) << check_p2p(logs).report;
  // Or both in one group.
  logs[0] = {issue(0, {recv_from(1, 2), send_to(1, 1)}), wait(0)};
  EXPECT_TRUE(check_p2p(logs).ok) << check_p2p(logs).report;
}

TEST(P2PCheck, AHostWaitingBeforeItSendsHangs) {
  std::map<int, P2PLog> logs;
  logs[0] = {issue(0, {recv_from(1, 2)}), wait(0), issue(1, {send_to(1, 1)})};
  logs[1] = {issue(0, {recv_from(0, 1)}), wait(0), issue(1, {send_to(0, 2)})};
  const P2PCheck check = check_p2p(logs);
  EXPECT_FALSE(check.ok);
  EXPECT_TRUE(contains(check.report, "rank 0 waits for its group 0 on c")) << check.report;
  EXPECT_TRUE(contains(check.report, "which that rank has not issued")) << check.report;
}

TEST(P2PCheck, OperationsMatchInOrderAndMustCarryTheSameMessage) {
  std::map<int, P2PLog> logs;
  logs[0] = {issue(0, {send_to(1, 1), send_to(1, 2)})};
  logs[1] = {issue(0, {recv_from(0, 2), recv_from(0, 1)}), wait(0)};
  P2PCheck check = check_p2p(logs);
  EXPECT_FALSE(check.ok);
  EXPECT_TRUE(contains(check.report, "is matched by order to rank 1's recv 2 from rank 0, which waits for another message"))
      << check.report;
  logs[1] = {issue(0, {recv_from(0, 1), recv_from(0, 2, 4)}), wait(0)};
  check = check_p2p(logs);
  EXPECT_TRUE(contains(check.report, "moves 8 bytes but is matched to rank 1's recv 2 from rank 0 of 4")) << check.report;
  logs[1] = {issue(0, {recv_from(0, 1)}), wait(0)};
  check = check_p2p(logs);
  EXPECT_TRUE(contains(check.report, "rank 0's send 2 to rank 1 on c is never received")) << check.report;
  logs[1] = {issue(0, {recv_from(0, 1), recv_from(0, 2), recv_from(0, 3)}), wait(0)};
  check = check_p2p(logs);
  EXPECT_TRUE(contains(check.report, "rank 1's recv 3 from rank 0 on c is never sent")) << check.report;
}

TEST(P2PCheck, ARingIssuedStepByStepCompletesOnlyGrouped) {
  for (int n = 2; n <= 8; ++n) {
    std::map<int, P2PLog> grouped, alone;
    for (int r = 0; r < n; ++r) {
      for (int step = 0; step < n - 1; ++step) {
        grouped[r].push_back(issue(step, {send_to((r + 1) % n, step), recv_from((r + n - 1) % n, step)}));
        grouped[r].push_back(wait(step));
        alone[r].push_back(issue(2 * step, {send_to((r + 1) % n, step)}));
        alone[r].push_back(issue(2 * step + 1, {recv_from((r + n - 1) % n, step)}));
        alone[r].push_back(wait(2 * step + 1));
      }
    }
    EXPECT_TRUE(check_p2p(grouped).ok) << n;
    EXPECT_FALSE(check_p2p(alone).ok) << n;
  }
}

// Every schedule x pp (2..8) x virtual stages (1..4) x microbatches (1..24)
// the planner accepts, training and evaluation: the grouped programs cannot
// hang on NCCL. The programs are the ones Pipeline::run executes.
TEST(P2PCheck, EveryAcceptedScheduleIsProvenInTheGroupedOrder) {
  int shapes = 0, posted_hangs = 0;
  for (const std::string& name : schedule_names()) {
    const ScheduleKind kind = *schedule_named(name);
    for (int pp = 2; pp <= 8; ++pp) {
      for (int v = 1; v <= 4; ++v) {
        for (int m = 1; m <= 24; ++m) {
          const PipelineShape shape = shape_for(kind, pp, v, m);
          if (check_shape(kind, shape)) continue;
          ++shapes;
          EXPECT_EQ(check_schedule_p2p(kind, shape, P2POrder::kGrouped), "") << name << " pp " << pp << " v " << v << " m " << m;
          if (!check_schedule_p2p(kind, shape, P2POrder::kPosted).empty()) ++posted_hangs;
        }
      }
    }
  }
  std::cout << "grouped order proven for " << shapes << " schedule shapes (training and evaluation); the posted order "
            << "hangs on NCCL in " << posted_hangs << " of them\n";
  EXPECT_EQ(shapes, 1510);  // what the ranges above hold
  EXPECT_GT(posted_hangs, 0);
}

// The mutation: the order Gloo runs (each receive posted alone ahead of the
// compute before it, each send alone after its compute) on NCCL's rules.
// Activations go one way and gradients the other, and each waits for the
// other behind it on a stream: the hang the grouping removes.
TEST(P2PCheck, TheGlooOrderHangsOnNccl) {
  const std::string report =
      check_schedule_p2p(ScheduleKind::k1f1b, shape_for(ScheduleKind::k1f1b, 2, 1, 2), P2POrder::kPosted);
  EXPECT_TRUE(contains(report, "training: deadlock")) << report;
  EXPECT_TRUE(contains(report, "rank 0's RECV_B0.0 from rank 1 waits for rank 1's SEND_B1.0 to rank 0, queued behind its group [RECV_F1.1 from rank 0]"))
      << report;
  EXPECT_TRUE(contains(report, "rank 1's RECV_F1.1 from rank 0 waits for rank 0's SEND_F0.1 to rank 1, queued behind its group [RECV_B0.0 from rank 1]"))
      << report;
  EXPECT_EQ(check_schedule_p2p(ScheduleKind::k1f1b, shape_for(ScheduleKind::k1f1b, 2, 1, 2), P2POrder::kGrouped), "");
}

namespace {

// The sequences every rank of `yaml`'s mesh issues in a training step,
// recorded from its dry run, checked on NCCL's rules.
P2PCheck check_dry_runs(const std::string& yaml) {
  const ExperimentConfig c = parse_config(yaml, "x.yaml");
  int64_t world = 1;
  for (int64_t d : c.mesh.shape) world *= d;
  const Plan plan = make_plan(c, world);
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return check_p2p(p2p_logs(c, plan, ranks));
}

std::string llama(int seq, const std::string& mesh, const std::string& parallelize, int microbatches = 1) {
  return "name: t\nmodel: {name: llama, args: {dim: 16, n_layers: 4, n_heads: 2, n_kv_heads: 1, vocab_size: 16, "
         "multiple_of: 16, max_seq_len: " + std::to_string(seq) + "}}\n"
         "mesh: {" + mesh + ", device: cuda, memory_per_rank_mb: 100000}\n"
         "parallelize:\n" + parallelize +
         "train: {steps: 1, global_batch: 8, microbatches: " + std::to_string(microbatches) + "}\n"
         "data: {seq_len: " + std::to_string(seq) + "}\n";
}

}  // namespace

// The context-parallel ring as the code issues it (recorded from each rank's
// dry run): cp 2..8, both layouts, with and without activation checkpointing
// (whose recompute runs the forward ring again inside backward).
TEST(P2PCheck, TheContextParallelRingIsProvenFromItsRecordedSequences) {
  int configs = 0;
  int64_t groups = 0;
  for (int cp = 2; cp <= 8; ++cp) {
    for (const bool balanced : {true, false}) {
      for (const bool ac : {false, true}) {
        const std::string transforms =
            "  - context_parallel: {mesh_dim: cp, load_balance: " + std::string(balanced ? "true" : "false") + "}\n" +
            (ac ? "  - activation_checkpointing: {units: ['layers.*']}\n" : "");
        const P2PCheck check = check_dry_runs(llama(4 * cp, "shape: [" + std::to_string(cp) + "], names: [cp]", transforms));
        EXPECT_TRUE(check.ok) << "cp " << cp << " balanced " << balanced << " ac " << ac << ": " << check.report;
        EXPECT_GT(check.groups, 0);
        groups += check.groups;
        ++configs;
      }
    }
  }
  std::cout << configs << " context-parallel configs proven, " << groups << " groups issued in all\n";
}

// Pipelines that carry cp and fully_shard, every rank of the mesh recorded
// from its dry run: the pp groups and the cp rings together.
TEST(P2PCheck, PipelinesCarryingContextParallelAndFullyShardAreProven) {
  const std::vector<std::pair<std::string, std::string>> plans = {
      {"shape: [2, 2], names: [pp, cp]",
       "  - pipeline: {mesh_dim: pp, schedule: interleaved_1f1b, virtual_stages: 2, layers_per_stage: 1}\n"
       "  - context_parallel: {mesh_dim: cp}\n"
       "  - fully_shard: {mesh_dim: cp, units: [tok_embeddings, layers.*, norm, output], reshard_after_forward: false}\n"},
      {"shape: [2, 2], names: [pp, dp]",
       "  - pipeline: {mesh_dim: pp, schedule: 1f1b}\n"
       "  - fully_shard: {mesh_dim: dp, units: [tok_embeddings, layers.*, norm, output]}\n"},
      {"shape: [4, 2], names: [pp, cp]",
       "  - pipeline: {mesh_dim: pp, schedule: gpipe}\n"
       "  - context_parallel: {mesh_dim: cp, load_balance: false}\n"
       "  - activation_checkpointing: {units: ['layers.*']}\n"},
      {"shape: [2, 2], names: [pp, cp]",
       "  - pipeline: {mesh_dim: pp, schedule: zbv}\n"
       "  - context_parallel: {mesh_dim: cp}\n"},
  };
  for (const auto& [mesh, transforms] : plans) {
    const P2PCheck check = check_dry_runs(llama(16, mesh, transforms, 4));
    EXPECT_TRUE(check.ok) << mesh << "\n" << transforms << check.report;
    EXPECT_GT(check.groups, 0) << mesh;
    std::cout << mesh << ": " << check.groups << " groups, " << check.ops << " operations proven\n";
  }
}
