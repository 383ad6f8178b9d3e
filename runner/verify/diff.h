// composer diff's comparison: one step's tensors as a plan's ranks recorded
// them (runner/train/record.h) against the same step on one device, module by
// module, in execution order. Each rank's piece is compared with the part of
// the single-device tensor its placement names (its samples, its context-
// parallel positions, its tensor-parallel chunk, a parameter's box), and the
// pieces together must cover the whole tensor; so the comparison is of whole
// tensors, and it also names the rank whose piece differs.
#pragma once
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "runner/train/record_format.h"

namespace composer {

// One compared tensor: a module's output or the gradient into its input in
// one microbatch, or a parameter before the step, its gradient after the
// synchronisation, its value after the update.
struct DiffEntry {
  RecordKind kind = RecordKind::kOutput;
  std::string name;  // the module's or parameter's FQN
  std::string type;  // the module's class ("Linear")
  int64_t microbatch = 0;
  double max_abs = 0;  // max |plan - one device| over the tensor
  double scale = 0;    // max |one device|
  double rel = 0;      // max_abs / scale
  bool diverges = false;
  std::vector<int> ranks;         // the ranks whose piece diverges
  std::vector<int> holders;       // every rank that holds a piece
  std::string where;              // the (first diverging) piece's place in the whole tensor
  std::string problem;            // a piece that could not be placed, or elements no rank computed
  std::string direction() const;  // forward, backward, before the step, update
  std::string tensor() const;     // "output", "gradient into its input", "gradient (synchronised)", ...
  // The entry's place in one device's execution order (the single device's
  // record order of its tensor; negated for the synchronised gradients, which
  // are recorded in the model's order that backward reverses). The report
  // lists entries as the step runs them: parameters before the step, then per
  // microbatch the forward in module order and the backward in reverse, then
  // the gradients after synchronisation, then the update.
  int64_t order = 0;
};

struct DiffReport {
  int64_t step = 0;
  // An activation or gradient matches when max_abs <= rtol x scale; a
  // parameter's value when every element is within param_atol + param_rtol x
  // |one device| (composer check's rule for final parameters).
  double rtol = 0, param_rtol = 0, param_atol = 0;
  std::vector<DiffEntry> entries;  // execution order
  // Tensors left out, each with the reason: recorded on one device only (a
  // pipeline has no whole model), a module called several times in a
  // microbatch, a piece no layout places.
  std::vector<std::string> not_compared;
  int diverging() const;
  const DiffEntry* first() const;  // the first divergence, or nullptr
  const DiffEntry* worst() const;  // the entry closest to (or furthest over) its tolerance
  nlohmann::json to_json() const;
};

// Compares the records in `plan_dir` (every rank's) with those in
// `single_dir` (one rank's). Throws RuntimeFailure when a side recorded nothing.
DiffReport diff_records(const std::string& single_dir, const std::string& plan_dir, double rtol, double param_rtol,
                        double param_atol);

// The report for a reader: the first divergence in full, then up to `more` of the next ones.
void print_diff(std::ostream& os, const DiffReport& r, const std::string& what, int more = 10);

}  // namespace composer
