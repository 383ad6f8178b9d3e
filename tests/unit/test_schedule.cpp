// Pipeline schedules as pure action lists: over a grid of (pp, virtual
// stages, microbatches) every schedule the planner accepts runs in the
// simulator with every dependency in order, every send received, no
// deadlock, and exactly the bubble of its formula (unit-cost actions).
#include <gtest/gtest.h>

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
