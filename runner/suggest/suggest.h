// `composer suggest`: the plans of a model for a world of ranks, searched,
// checked and ranked. Every candidate (tp, cp, pp with its schedule and
// microbatches, dp as replicate, fully_shard or HSDP, activation checkpointing
// none, op or full, gradient accumulation) is written as the mesh and
// parallelize sections of the user's config and goes through the planner;
// the accepted ones are ranked by a cost model, and in that order each is run
// dry (the per-rank memory estimate, exact to the byte) until `top` of them
// fit the device memory with the margin. The best is written as a config.
#pragma once
#include <cstdint>
#include <functional>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/plan/planner.h"
#include "runner/suggest/probe.h"
#include "runner/suggest/world.h"

namespace composer {

struct Candidate {
  std::string name;   // "tp2.cp1.pp2_1f1b_m4.fsdp.ac_op.mb1"
  std::string yaml;    // the whole config: the user's sections (accumulation searched in) and its mesh and parallelize
  std::string family;              // the name less activation checkpointing (and accumulation without a pipeline)
  StepTerms terms;
  double step_s() const { return terms.step_s(); }
  int64_t peak = -1;    // the dry run's largest per-rank peak; -1: not run dry
  bool stopped = false; // the dry run stopped where a step passed the memory: peak is then the limit + 1
  double floor = 0;     // the closed-form floor under that peak (suggest_detail::memory_floor)
  bool fits = false;
  std::string refusal;  // the planner's reason, where it refused the plan
};

struct Suggestion {
  std::vector<Candidate> fitting;   // best first
  std::vector<Candidate> unfit;     // run dry, over the memory, in cost order
  std::vector<Candidate> others;    // the rest, in cost order, their yaml left out: refused (with the reason),
                                    // passed over (a cheaper member of their family fits, or their memory
                                    // floor is over the memory), or priced only
  int64_t candidates = 0;   // shapes priced
  int64_t floored = 0;      // of them, in cost order, passed over because their memory floor exceeds the memory
  int64_t dominated = 0;    // of them, passed over because they certainly need more memory than a plan run dry
                            // over it (the same plan, buying less memory: suggest.cpp's needs_more_than)
  int64_t planned = 0;      // of them, in cost order, written as configs and put to the planner
  int64_t refused = 0;      // refused by the planner (or its estimate)
  int64_t estimated = 0;    // run dry
  bool out_of_time = false; // the dry runs stopped at the time given, with fewer than `top` fitting
  bool memory_first = false; // none fit by a third of the time given in cost order: the rest were run dry
                             // in the order of their memory floors (the least first)
  std::string first_refusal;        // an example of the planner's reasons
  double flops_per_step = 0;        // the model's, one step of the global batch: 6 x matrix parameters per
                                    // token (embedding tables left out) + attention's 12 x layers x dim x seq
};

// Throws UserError for an override of the mesh or parallelize, which suggest chooses.
void check_suggest_overrides(const std::vector<std::string>& overrides);

// Searches the plans of the config at `path` (with `overrides`; its own mesh
// and parallelize are ignored) for `world`; `max_estimates` caps the dry runs, and once a plan fits,
// `max_seconds` their time.
// `progress`, where given, hears of each dry run as it ends (the candidate and its seconds).
using DryRunProgress = std::function<void(const Candidate&, double seconds)>;
Suggestion suggest(const std::string& path, const std::vector<std::string>& overrides, World& world, int top,
                   int max_estimates, double max_seconds, const DryRunProgress& progress = {});

// The config of the plan fitting[pick] (0: the best), headed by a comment on
// the choice, the runners-up and the rates assumed.
std::string suggested_yaml(const Suggestion& s, const World& world, size_t pick = 0);

// Why the chosen plan beats the runner-up: the terms that differ most, in ms.
std::string explain_choice(const Candidate& best, const Candidate& next);

// Every candidate's terms, the world's rates and the counts, as JSON (composer suggest --json).
nlohmann::json suggestion_json(const Suggestion& s, const World& w);

// A finished run's measured step against the cost model's price of its own plan (composer suggest
// --from-run DIR): the lines to print; refits `w.rates` (compute and communication) from it.
// `c` and `plan`: the config the run was started with (its hash must be the run's).
std::vector<std::string> compare_with_run(const std::string& run_dir, const ExperimentConfig& c, const Plan& plan,
                                          World& w);

}  // namespace composer
