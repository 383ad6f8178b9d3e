// Pipeline schedules as pure data: per-rank ordered lists of actions over
// (stage, microbatch), generated without any process group, then checked and
// timed by a simulator with unit-cost actions. The runtime executes the same
// lists with send/recv.
//
// Stages: `pp` ranks hold `virtual_stages` stages each, S = pp * v stages in
// all. Loop placement puts stage s on rank s % pp; V placement (zbv, v = 2)
// puts stages 0..pp-1 on ranks 0..pp-1 and stages pp..2pp-1 back on ranks
// pp-1..0, so the first and the last stage share rank 0. dualpipev uses the
// same V.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallelisms/config_fields.h"

namespace composer::parallel {

enum class ScheduleKind { kGpipe, k1f1b, kInterleaved1f1b, kLoopedBfs, kInterleavedZeroBubble, kZbv, kDualPipeV };
inline constexpr EnumName<ScheduleKind> kScheduleNames[] = {{ScheduleKind::kGpipe, "gpipe"},
                                                           {ScheduleKind::k1f1b, "1f1b"},
                                                           {ScheduleKind::kInterleaved1f1b, "interleaved_1f1b"},
                                                           {ScheduleKind::kLoopedBfs, "looped_bfs"},
                                                           {ScheduleKind::kInterleavedZeroBubble, "interleaved_zero_bubble"},
                                                           {ScheduleKind::kZbv, "zbv"},
                                                           {ScheduleKind::kDualPipeV, "dualpipev"}};
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
  // A backward (B) that forms one overlapped pair with the forward right
  // before it in the list (DualPipeV's F&B, on the other stage of the rank):
  // the pair's receives come before both, its sends after both, and the
  // simulator runs the two as one block (ActionCosts::overlapped). The
  // runtime computes them one after the other.
  bool overlapped = false;
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

// Whether a schedule's stages form a V (zbv, dualpipev).
bool v_schedule(ScheduleKind kind);
// Whether it splits backwards into I and W (records the Linear layers' inputs at forward).
bool zero_bubble(ScheduleKind kind);

// The shape a schedule runs on (V placement for zbv and dualpipev), or the reason it
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

// The time each compute action takes in the simulator; unit costs by default.
struct ActionCosts {
  int64_t forward = 1, backward = 1, input = 1, weight = 1;
  int64_t overlapped = 0;  // an overlapped F&B pair; 0: forward + backward (one after the other)
  int64_t pair() const { return overlapped > 0 ? overlapped : forward + backward; }
};

struct Simulation {
  bool ok = false;
  std::string error;                // a dependency out of order, an unmatched send, a deadlock
  int64_t makespan = 0;             // time slots until the last action ends
  int64_t compute_slots = 0;        // busy time over all ranks (unit costs: compute actions)
  std::vector<std::vector<int64_t>> start;  // per rank, per action: its start slot (-1 for comm)
  double bubble() const;            // idle fraction: 1 - compute / (ranks x makespan)
};

// Runs the lists (with communication actions) with compute of the given
// costs, instant sends that never block, and receives that wait for their send.
Simulation simulate(const std::vector<RankActions>& with_comm, const PipelineShape& shape, const ActionCosts& costs = {});

// The bubble fraction the schedule is built to have, with unit-cost actions
// (dualpipev: a backward costs two, as I + W).
double bubble_formula(ScheduleKind kind, const PipelineShape& shape);
// The same for any costs: dualpipev by DualPipe's formula, the idle time
// (pp - 1)(F&B + B - 3W) on each rank, which needs B = I + W; the others
// scale with their unit-cost formula only when every compute action costs the same.
double bubble_formula(ScheduleKind kind, const PipelineShape& shape, const ActionCosts& costs);

}  // namespace composer::parallel
