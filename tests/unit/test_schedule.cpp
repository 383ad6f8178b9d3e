// Pipeline schedules as pure action lists: over a grid of (pp, virtual
// stages, microbatches) every schedule the planner accepts runs in the
// simulator with every dependency in order, every send received, no
// deadlock, and exactly the bubble of its formula (unit-cost actions).
#include <gtest/gtest.h>

#include <map>

#include "parallelisms/pipeline/schedule.h"

namespace composer::parallel {
namespace {

const ScheduleKind kAll[] = {ScheduleKind::kGpipe,     ScheduleKind::k1f1b,
                             ScheduleKind::kInterleaved1f1b, ScheduleKind::kLoopedBfs,
                             ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv};

TEST(PipelineSchedule, EveryScheduleOnTheGridIsValidAndHasItsFormulaBubble) {
  int checked = 0;
  for (auto kind : kAll) {
    int per_kind = 0;
    for (int pp = 1; pp <= 6; ++pp) {
      for (int v = 1; v <= 3; ++v) {
        for (int m = 1; m <= 16; ++m) {
          auto shape = shape_for(kind, pp, v, m);
          if (check_shape(kind, shape)) continue;
          auto lists = with_communication(compute_schedule(kind, shape), shape);
          auto sim = simulate(lists, shape);
          const std::string where = std::string(name_of(kind)) + " pp " + std::to_string(pp) + " v " +
                                    std::to_string(v) + " m " + std::to_string(m);
          ASSERT_TRUE(sim.ok) << where << ": " << sim.error;
          EXPECT_NEAR(sim.bubble(), bubble_formula(kind, shape), 1e-12) << where;
          const int per_stage = kind == ScheduleKind::kInterleavedZeroBubble || kind == ScheduleKind::kZbv ? 3 : 2;
          EXPECT_EQ(sim.compute_slots, static_cast<int64_t>(pp) * v * m * per_stage) << where;
          ++per_kind;
        }
      }
    }
    EXPECT_GT(per_kind, 20) << name_of(kind);
    checked += per_kind;
  }
  EXPECT_GT(checked, 500);
}

TEST(PipelineSchedule, OneFOneBKeepsPpMinusRankMicrobatchesInFlight) {
  auto shape = shape_for(ScheduleKind::k1f1b, 4, 1, 8);
  auto lists = compute_schedule(ScheduleKind::k1f1b, shape);
  for (int r = 0; r < 4; ++r) {
    int in_flight = 0, peak = 0;
    for (const auto& a : lists[r]) {
      in_flight += a.op == Op::kForward ? 1 : -1;
      peak = std::max(peak, in_flight);
    }
    EXPECT_EQ(peak, 4 - r) << "rank " << r;
  }
  // The last rank alternates from the start: F0 B0 F1 B1 ...
  EXPECT_EQ(lists[3][0].str(), "F3.0");
  EXPECT_EQ(lists[3][1].str(), "B3.0");
}

TEST(PipelineSchedule, PlacementLoopsOrFormsAV) {
  auto loop = shape_for(ScheduleKind::kInterleaved1f1b, 2, 2, 4);
  EXPECT_EQ(loop.stages_of(0), std::vector<int>({0, 2}));
  EXPECT_EQ(loop.stages_of(1), std::vector<int>({1, 3}));
  auto v = shape_for(ScheduleKind::kZbv, 2, 2, 4);
  EXPECT_EQ(v.stages_of(0), std::vector<int>({0, 3}));  // first and last stage on rank 0
  EXPECT_EQ(v.stages_of(1), std::vector<int>({1, 2}));
}

TEST(PipelineSchedule, CommunicationIsInsertedOnlyBetweenRanks) {
  auto shape = shape_for(ScheduleKind::kZbv, 2, 2, 4);
  auto lists = with_communication(compute_schedule(ScheduleKind::kZbv, shape), shape);
  for (const auto& a : lists[1]) {
    // Stages 1 and 2 share rank 1: stage 1's activation goes to stage 2 locally.
    EXPECT_FALSE(a.op == Op::kSendActivation && a.stage == 1) << a.str();
    EXPECT_FALSE(a.op == Op::kRecvActivation && a.stage == 2) << a.str();
  }
}

TEST(PipelineSchedule, TheSimulatorCatchesBrokenLists) {
  auto shape = shape_for(ScheduleKind::k1f1b, 2, 1, 2);
  auto lists = with_communication(compute_schedule(ScheduleKind::k1f1b, shape), shape);
  // A receive that comes before its send on the same rank pair, in a cycle: deadlock.
  auto swapped = lists;
  std::swap(swapped[0].front(), swapped[0].back());  // rank 0 starts by waiting for a gradient
  auto sim = simulate(swapped, shape);
  EXPECT_FALSE(sim.ok);
  EXPECT_NE(sim.error.find("rank 0"), std::string::npos) << sim.error;
  // A dropped receive: the send is never received (and the forward runs without its input).
  auto dropped = lists;
  dropped[1].erase(dropped[1].begin());
  sim = simulate(dropped, shape);
  EXPECT_FALSE(sim.ok);
  // A backward before its forward.
  auto early = compute_schedule(ScheduleKind::k1f1b, shape);
  std::swap(early[1][0], early[1][1]);
  sim = simulate(with_communication(early, shape), shape);
  EXPECT_FALSE(sim.ok);
  EXPECT_NE(sim.error.find("before its forward"), std::string::npos) << sim.error;
  // A stage run on a rank that does not hold it.
  auto wrong = lists;
  wrong[0].push_back({Op::kForward, 1, 0});
  sim = simulate(wrong, shape);
  EXPECT_FALSE(sim.ok);
}

TEST(PipelineSchedule, ShapesASchedulesCannotRunAreRejectedWithTheReason) {
  EXPECT_NE(check_shape(ScheduleKind::k1f1b, shape_for(ScheduleKind::k1f1b, 4, 1, 2))->find("at least as many microbatches"),
            std::string::npos);
  EXPECT_NE(check_shape(ScheduleKind::kGpipe, shape_for(ScheduleKind::kGpipe, 2, 2, 4))->find("one stage per rank"),
            std::string::npos);
  EXPECT_NE(check_shape(ScheduleKind::kInterleaved1f1b, shape_for(ScheduleKind::kInterleaved1f1b, 2, 2, 5))
                ->find("not a multiple of 2"),
            std::string::npos);
  EXPECT_NE(check_shape(ScheduleKind::kZbv, shape_for(ScheduleKind::kZbv, 2, 3, 8))->find("exactly 2"), std::string::npos);
  EXPECT_FALSE(check_shape(ScheduleKind::kGpipe, shape_for(ScheduleKind::kGpipe, 4, 1, 1)));
  EXPECT_EQ(schedule_named("looped_bfs"), ScheduleKind::kLoopedBfs);
  EXPECT_FALSE(schedule_named("1f1b_interleaved"));
}

}  // namespace
}  // namespace composer::parallel

namespace composer::parallel {
namespace {

std::string listed(const RankActions& actions) {
  std::string out;
  for (const Action& a : actions) out += (out.empty() ? "" : " ") + std::string(a.overlapped ? "&" : "") + a.str();
  return out;
}

// DualPipe's bubble (its README): each rank idles (pp - 1)(F&B + B - 3W)
// beside its compute, 2m(F + B) less what its overlapped pairs save; the
// ranks with the most pairs, 2(m - pp) - 1, set the makespan.
int64_t dual_pipe_makespan(int pp, int m, const ActionCosts& c) {
  const int64_t pairs = 2 * (m - pp) - 1;
  return 2 * m * (c.forward + c.backward) - pairs * (c.forward + c.backward - c.pair()) +
         (pp - 1) * (c.pair() + c.backward - 3 * c.weight);
}

}  // namespace

TEST(PipelineSchedule, DualPipeVOrdersEachRankAsPyTorchDoes) {
  // Generated by torch 2.11's ScheduleDualPipeV._calculate_single_rank_operations;
  // "&B" is the backward of an OVERLAP_F_B pair with the forward before it.
  const std::map<std::pair<int, int>, std::vector<std::string>> torch_lists = {
      {{2, 4},
       {"F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 F0.3 &B3.1 F3.2 &B0.0 B3.2 F3.3 &B0.1 B3.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2 &B1.0 F1.3 &B2.1 F2.3 &B1.1 B2.2 B1.2 I2.3 I1.3 W2.3 W1.3"}},
      {{3, 7},
       {"F0.0 F0.1 F0.2 F0.3 F0.4 F5.0 I5.0 W5.0 F5.1 I5.1 W5.1 F5.2 F0.5 &B5.2 F5.3 &B0.0 F0.6 &B5.3 F5.4 &B0.1 "
        "B5.4 F5.5 &B0.2 B5.5 F5.6 &B0.3 B5.6 I0.4 W0.4 I0.5 W0.5 I0.6 W0.6",
        "F1.0 F1.1 F1.2 F4.0 F1.3 F4.1 I4.0 W4.0 F4.2 F1.4 &B4.1 F4.3 &B1.0 F1.5 &B4.2 F4.4 &B1.1 F1.6 &B4.3 F4.5 "
        "&B1.2 B4.4 F4.6 &B1.3 B4.5 B1.4 I4.6 I1.5 W4.6 I1.6 W1.5 W1.6",
        "F2.0 F3.0 F2.1 F3.1 F2.2 F3.2 F2.3 B3.0 F3.3 &B2.0 F2.4 &B3.1 F3.4 &B2.1 F2.5 &B3.2 F3.5 &B2.2 F2.6 &B3.3 "
        "F3.6 &B2.3 B3.4 B2.4 B3.5 I2.5 I3.6 I2.6 W2.5 W3.6 W2.6"}}};
  for (const auto& [pm, expected] : torch_lists) {
    auto shape = shape_for(ScheduleKind::kDualPipeV, pm.first, 2, pm.second);
    auto lists = compute_schedule(ScheduleKind::kDualPipeV, shape);
    ASSERT_EQ(lists.size(), expected.size());
    for (size_t r = 0; r < lists.size(); ++r) EXPECT_EQ(listed(lists[r]), expected[r]) << "pp " << pm.first << " rank " << r;
  }
}

TEST(PipelineSchedule, DualPipeVRunsWithDualPipesBubble) {
  // Costs as (F, B, I, W, F&B) with B = I + W: the pair run one after the
  // other (F&B = F + B), overlapped by a little and by a lot.
  const ActionCosts costs[] = {{1, 2, 1, 1, 0}, {1, 2, 1, 1, 2}, {2, 4, 2, 2, 5}, {2, 4, 2, 2, 4}, {3, 6, 3, 3, 7}};
  int checked = 0;
  for (const ActionCosts& c : costs) {
    for (int pp = 1; pp <= 8; ++pp) {
      for (int m = 2 * pp; m <= 24; ++m) {
        auto shape = shape_for(ScheduleKind::kDualPipeV, pp, 2, m);
        ASSERT_FALSE(check_shape(ScheduleKind::kDualPipeV, shape));
        auto sim = simulate(with_communication(compute_schedule(ScheduleKind::kDualPipeV, shape), shape), shape, c);
        const std::string where = "pp " + std::to_string(pp) + " m " + std::to_string(m) + " F&B " +
                                  std::to_string(c.pair());
        ASSERT_TRUE(sim.ok) << where << ": " << sim.error;
        EXPECT_EQ(sim.makespan, dual_pipe_makespan(pp, m, c)) << where;
        EXPECT_NEAR(sim.bubble(), bubble_formula(ScheduleKind::kDualPipeV, shape, c), 1e-12) << where;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 5 * 128);
  // Run one after the other, DualPipeV idles twice as long as zbv's (pp - 1) unit slots at the same cost.
  auto shape = shape_for(ScheduleKind::kDualPipeV, 4, 2, 8);
  EXPECT_EQ(simulate(with_communication(compute_schedule(ScheduleKind::kDualPipeV, shape), shape), shape,
                     ActionCosts{1, 2, 1, 1, 0}).makespan,
            2 * 8 * 3 + 2 * 3);
  // Too few microbatches, or a V of other than two stages per rank.
  EXPECT_EQ(check_shape(ScheduleKind::kDualPipeV, shape_for(ScheduleKind::kDualPipeV, 4, 2, 7)).value_or(""),
            "dualpipev needs at least 2 x pp = 8 microbatches, not 7");
  EXPECT_TRUE(check_shape(ScheduleKind::kDualPipeV, shape_for(ScheduleKind::kDualPipeV, 4, 3, 8)).has_value());
}

TEST(PipelineSchedule, AnOverlappedPairSendsAfterBothAndReceivesBeforeBoth) {
  auto shape = shape_for(ScheduleKind::kDualPipeV, 3, 2, 7);
  auto lists = with_communication(compute_schedule(ScheduleKind::kDualPipeV, shape), shape);
  // On the middle rank, F1.5 (from rank 0, to rank 2) with B4.2 (from rank 0, to rank 2).
  const std::string all = listed(lists[1]);
  EXPECT_NE(all.find("RECV_F1.5 RECV_B4.2 F1.5 &B4.2 SEND_F1.5 SEND_B4.2"), std::string::npos) << all;
  // A list whose overlapped backward follows no forward is refused.
  auto broken = lists;
  for (auto& a : broken[0]) {
    if (a.op == Op::kBackwardWeight) {
      a.overlapped = true;
      break;
    }
  }
  auto sim = simulate(broken, shape);
  EXPECT_FALSE(sim.ok);
  EXPECT_NE(sim.error.find("W5.0 is marked overlapped; only a full backward (B) right after a forward can be"), std::string::npos) << sim.error;
}

}  // namespace composer::parallel
