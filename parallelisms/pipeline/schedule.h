// Pipeline schedules as pure data: per-rank ordered lists of actions over
// (stage, microbatch), generated without any process group, then checked and
// timed by a simulator with unit-cost actions. The runtime executes the same
// lists with send/recv.
//
// Stages: `pp` ranks hold `virtual_stages` stages each, S = pp * v stages in
// all. Loop placement puts stage s on rank s % pp; V placement (zbv, v = 2)
// puts stages 0..pp-1 on ranks 0..pp-1 and stages pp..2pp-1 back on ranks
// pp-1..0, so the first and the last stage share rank 0.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallelisms/config_fields.h"

namespace composer::parallel {

enum class ScheduleKind { kGpipe, k1f1b, kInterleaved1f1b, kLoopedBfs, kInterleavedZeroBubble, kZbv };
inline constexpr EnumName<ScheduleKind> kScheduleNames[] = {{ScheduleKind::kGpipe, "gpipe"},
                                                           {ScheduleKind::k1f1b, "1f1b"},
                                                           {ScheduleKind::kInterleaved1f1b, "interleaved_1f1b"},
                                                           {ScheduleKind::kLoopedBfs, "looped_bfs"},
                                                           {ScheduleKind::kInterleavedZeroBubble, "interleaved_zero_bubble"},
                                                           {ScheduleKind::kZbv, "zbv"}};
inline const auto& names_of(ScheduleKind) { return kScheduleNames; }

const char* name_of(ScheduleKind k);
// Every schedule name, in the order above.
std::vector<std::string> schedule_names();
std::optional<ScheduleKind> schedule_named(const std::string& name);

enum class Op {
  kForward,         // F: the stage's forward of one microbatch
  kBackward,        // B: input and weight gradients together
  kBackwardInput,   // I: the input gradient only (zero-bubble schedules)
  kBackwardWeight,  // W: the weight gradient, deferred
  kSendActivation,  // to the rank of stage + 1
  kRecvActivation,  // from the rank of stage - 1
  kSendGradient,    // to the rank of stage - 1
  kRecvGradient,    // from the rank of stage + 1
};

struct Action {
  Op op;
  int stage;
  int microbatch;
  bool operator==(const Action& o) const { return op == o.op && stage == o.stage && microbatch == o.microbatch; }
  std::string str() const;  // e.g. "F3.1" (stage 3, microbatch 1), "SEND_F3.1"
};

struct PipelineShape {
  int pp = 1;              // ranks
  int virtual_stages = 1;  // stages per rank
  int microbatches = 1;
  bool v_placement = false;
  int stages() const { return pp * virtual_stages; }
  int rank_of(int stage) const;
  std::vector<int> stages_of(int rank) const;  // ascending
};

// The shape a schedule runs on (V placement for zbv), or the reason it
// cannot: a schedule that needs one stage per rank given several, too few
// microbatches, and so on.
std::optional<std::string> check_shape(ScheduleKind kind, const PipelineShape& shape);
PipelineShape shape_for(ScheduleKind kind, int pp, int virtual_stages, int microbatches);

using RankActions = std::vector<Action>;

// Compute actions only (F, B or I and W), per rank.
std::vector<RankActions> compute_schedule(ScheduleKind kind, const PipelineShape& shape);
// The same with sends after each action whose result another rank needs,
// and receives before each action that needs another rank's result.
std::vector<RankActions> with_communication(const std::vector<RankActions>& compute, const PipelineShape& shape);

struct Simulation {
  bool ok = false;
  std::string error;                // a dependency out of order, an unmatched send, a deadlock
  int64_t makespan = 0;             // time slots until the last action ends
  int64_t compute_slots = 0;        // compute actions over all ranks (each takes one slot)
  std::vector<std::vector<int64_t>> start;  // per rank, per action: its start slot (-1 for comm)
  double bubble() const;            // idle fraction: 1 - compute / (ranks x makespan)
};

// Runs the lists (with communication actions) with unit-cost compute,
// instant sends that never block, and receives that wait for their send.
Simulation simulate(const std::vector<RankActions>& with_comm, const PipelineShape& shape);

// The bubble fraction the schedule is built to have, with unit-cost actions.
double bubble_formula(ScheduleKind kind, const PipelineShape& shape);

}  // namespace composer::parallel
