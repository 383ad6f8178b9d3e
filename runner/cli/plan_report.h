// What `composer plan` prints: for people, a short summary (the plan, the
// parameters' placements grouped, each rank's memory and communication as
// tables); for tools (--json), one JSON object with the resolved config and
// the same facts in full.
#pragma once
#include <nlohmann/json.hpp>
#include <ostream>

#include "runner/config/config.h"
#include "runner/plan/planner.h"

namespace composer {

void print_plan(std::ostream& os, const ExperimentConfig& c, const Plan& p);

// composer plan --samples: one line per sample of preview_samples' list.
void print_samples(std::ostream& os, const nlohmann::json& samples);

// {"config": the resolved config, "config_hash", "summary", "warnings",
//  "placements": [{name, shape, placement, gradient}], "ranks": [{rank,
//  params, grads, optimizer, buffers, activations, data, peak, comm}]}.
nlohmann::json plan_json(const ExperimentConfig& c, const Plan& p);

}  // namespace composer
