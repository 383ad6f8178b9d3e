#include "runner/cli/plan_report.h"

#include <iomanip>
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "runner/checkpoint/weight_source.h"
#include "runner/estimate/dry_run.h"
#include "runner/estimate/estimate.h"
#include "runner/train/build.h"

namespace composer {
namespace {

// The name with each all-digit segment (a layer's index) as '*'.
std::string name_pattern(const std::string& name) {
  std::string out, segment;
  auto flush = [&] {
    const bool digits = !segment.empty() && segment.find_first_not_of("0123456789") == std::string::npos;
    out += digits ? "*" : segment;
    segment.clear();
  };
  for (char ch : name) {
    if (ch == '.') {
      flush();
      out += '.';
    } else {
      segment += ch;
    }
  }
  flush();
  return out;
}

// "0-3, 6" for ranks 0, 1, 2, 3, 6.
std::string ranks_str(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

std::string comm_line(const CommBytes& comm) {
  std::string out;
  for (const auto& [group, kinds] : comm) {
    for (const auto& [kind, bytes] : kinds) {
      if (bytes) out += (out.empty() ? "" : ", ") + group + " " + kind + " " + format_bytes(bytes);
    }
  }
  return out.empty() ? "none" : out;
}

// Parameters with the same name pattern, shape, placement and gradient, in
// the order they first appear.
struct PlacementGroup {
  PlacementRow row;  // name: the pattern
  int count = 0;
};

std::vector<PlacementGroup> group_placements(const std::vector<PlacementRow>& rows) {
  std::vector<PlacementGroup> out;
  std::map<std::string, size_t> index;
  for (const auto& r : rows) {
    const std::string pattern = name_pattern(r.name);
    const std::string key = pattern + "|" + r.shape + "|" + r.placement + "|" + r.gradient;
    auto [it, fresh] = index.emplace(key, out.size());
    if (fresh) out.push_back({{pattern, r.shape, r.placement, r.gradient}, 0});
    ++out[it->second].count;
  }
  return out;
}

void print_placements(std::ostream& os, const std::vector<PlacementRow>& rows) {
  const auto groups = group_placements(rows);
  os << "placements: " << rows.size() << " parameters in " << groups.size()
     << " groups (* stands for any index; --json lists each parameter)\n";
  size_t wn = 0, ws = 0, wp = 0;
  auto label = [](const PlacementGroup& g) { return g.row.name + (g.count > 1 ? " x" + std::to_string(g.count) : ""); };
  for (const auto& g : groups) {
    wn = std::max(wn, label(g).size());
    ws = std::max(ws, g.row.shape.size());
    wp = std::max(wp, g.row.placement.size());
  }
  for (const auto& g : groups) {
    os << "  " << std::left << std::setw(static_cast<int>(wn)) << label(g) << "  " << std::setw(static_cast<int>(ws))
       << g.row.shape << "  " << std::setw(static_cast<int>(wp)) << g.row.placement
       << "  gradient: " << (g.row.gradient.empty() ? "none" : g.row.gradient) << "\n";
  }
}

// Each rank's estimate, ranks with the same figures on one row.
void print_estimates(std::ostream& os, const std::vector<MemoryEstimate>& estimates) {
  std::vector<std::pair<std::vector<int>, const MemoryEstimate*>> rows;
  for (const auto& e : estimates) {
    bool merged = false;
    for (auto& [ranks, first] : rows) {
      if (e.str() == first->str() && e.comm_str() == first->comm_str()) {
        ranks.push_back(e.rank);
        merged = true;
        break;
      }
    }
    if (!merged) rows.push_back({{e.rank}, &e});
  }
  os << "memory per rank (estimate):\n";
  const char* heads[] = {"ranks", "params", "grads", "optimizer", "buffers", "activations", "data", "peak"};
  std::vector<std::vector<std::string>> table;
  for (const auto& [ranks, e] : rows) {
    table.push_back({ranks_str(ranks), format_bytes(e->params), format_bytes(e->grads), format_bytes(e->optimizer),
                     format_bytes(e->buffers), format_bytes(e->activations), format_bytes(e->data),
                     format_bytes(e->peak())});
  }
  std::vector<size_t> w(8);
  for (size_t i = 0; i < 8; ++i) {
    w[i] = std::string(heads[i]).size();
    for (const auto& r : table) w[i] = std::max(w[i], r[i].size());
  }
  for (size_t i = 0; i < 8; ++i)
    os << (i ? "  " : "  ") << (i ? std::right : std::left) << std::setw(static_cast<int>(w[i])) << heads[i];
  os << "\n";
  for (const auto& r : table) {
    for (size_t i = 0; i < 8; ++i)
      os << "  " << (i ? std::right : std::left) << std::setw(static_cast<int>(w[i])) << r[i];
    os << "\n";
  }
  for (const auto& [ranks, e] : rows) {
    if (e->checkpoint_copy) {
      os << std::left << "  ranks " << ranks_str(ranks) << ": peak includes at most " << format_bytes(e->checkpoint_copy)
         << " of checkpoint.async's host copy\n";
    }
  }
  os << std::left << "communication per rank and step (estimate):\n";
  for (const auto& [ranks, e] : rows) os << "  ranks " << ranks_str(ranks) << ": " << comm_line(e->comm) << "\n";
}

int64_t highest_peak(const std::vector<MemoryEstimate>& estimates) {
  int64_t most = 0;
  for (const auto& e : estimates) most = std::max(most, e.peak());
  return most;
}

// train.freeze or train.lora: what trains and what is frozen, and the highest
// rank's peak against training every parameter of the model (no adapters).
void print_frozen(std::ostream& os, const ExperimentConfig& c, const Plan& p,
                  const std::vector<MemoryEstimate>& estimates) {
  if (c.train.freeze.empty() && !c.train.lora) return;
  nn::ShapeOnly shapes;
  models::ModelPtr model = build_model(c);
  const std::set<std::string> frozen = frozen_names(*model, c.train);
  int64_t trained = 0, fixed = 0, count = 0;
  for (const auto& [name, t] : nn::unique_named_parameters(*model)) {
    (frozen.count(name) ? fixed : trained) += t.numel();
    ++count;
  }
  ExperimentConfig full = c;
  full.train.freeze.clear();
  full.train.lora.reset();
  full.model.lora_from.clear();
  const int64_t with = highest_peak(estimates), without = highest_peak(estimate_memory(full, p));
  char line[400];
  std::snprintf(line, sizeof line,
                "%s: %zu of %lld parameters train (%lld values, %.2f%%), %zu frozen (%lld values): no gradient or "
                "optimizer state; highest peak %s, against %s training every parameter without %s (%s)\n",
                c.train.lora ? "train.lora" : "train.freeze", static_cast<size_t>(count) - frozen.size(),
                static_cast<long long>(count), static_cast<long long>(trained),
                100.0 * static_cast<double>(trained) / static_cast<double>(std::max<int64_t>(1, trained + fixed)),
                frozen.size(), static_cast<long long>(fixed), format_bytes(with).c_str(), format_bytes(without).c_str(),
                c.train.lora ? "adapters" : "train.freeze",
                (without >= with ? format_bytes(without - with) + " saved" : format_bytes(with - without) + " more").c_str());
  os << line;
}

// optimizer muon: how many matrices it orthogonalises and what making them whole moves per step.
void print_muon(std::ostream& os, const MuonTraffic& t) {
  if (t.matrices == 0) return;
  os << "optimizer muon: " << t.matrices << " matrices (" << t.values << " values) orthogonalised whole, "
     << t.whole_here << " of them whole where they are held";
  if (t.bytes.empty()) {
    os << "; nothing moves\n";
    return;
  }
  os << "; per step over all ranks, to their owners and back (each matrix x (s - 1) / s per mesh dim of s ranks "
        "splitting it, within the sends and receives above):";
  const char* sep = " ";
  for (const auto& [dim, b] : t.bytes) {
    os << sep << dim << " " << format_bytes(b.first) << " + " << format_bytes(b.second);
    sep = ", ";
  }
  os << "\n";
}

nlohmann::json muon_json(const MuonTraffic& t) {
  nlohmann::json bytes = nlohmann::json::object();
  for (const auto& [dim, b] : t.bytes) bytes[dim] = {{"to_owners", b.first}, {"back", b.second}};
  return {{"matrices", t.matrices}, {"values", t.values}, {"whole_here", t.whole_here}, {"bytes", bytes}};
}

}  // namespace

void print_plan(std::ostream& os, const ExperimentConfig& c, const Plan& p) {
  for (const auto& line : p.summary) os << "plan: " << line << "\n";
  for (const auto& line : p.warnings) os << "warning: " << line << "\n";
  if (!c.model.from_hf.empty()) {
    const std::string note = WeightSource::open(c.model, c.train.lora)->skipped_note();
    if (!note.empty()) os << "plan: " << note << "\n";
  }
  const auto rows = describe_placements(c, p);
  if (!rows.empty()) print_placements(os, rows);
  const std::vector<MemoryEstimate> estimates = estimate_memory(c, p);
  print_estimates(os, estimates);
  print_frozen(os, c, p, estimates);
  print_muon(os, muon_traffic(c, p));
  os << "config hash " << config_hash(c) << "; the resolved config and every figure in full: composer plan --json\n";
}

nlohmann::json plan_json(const ExperimentConfig& c, const Plan& p) {
  nlohmann::json j;
  j["config"] = to_json(c);
  j["config_hash"] = config_hash(c);
  j["summary"] = p.summary;
  j["warnings"] = p.warnings;
  j["placements"] = nlohmann::json::array();
  for (const auto& r : describe_placements(c, p)) {
    j["placements"].push_back(
        {{"name", r.name}, {"shape", r.shape}, {"placement", r.placement}, {"gradient", r.gradient}});
  }
  if (c.train.optimizer.name == OptimizerKind::kMuon) j["muon"] = muon_json(muon_traffic(c, p));
  j["ranks"] = nlohmann::json::array();
  for (const auto& e : estimate_memory(c, p)) {
    j["ranks"].push_back({{"rank", e.rank},
                          {"params", e.params},
                          {"grads", e.grads},
                          {"optimizer", e.optimizer},
                          {"buffers", e.buffers},
                          {"activations", e.activations},
                          {"data", e.data},
                          {"checkpoint_copy", e.checkpoint_copy},
                          {"peak", e.peak()},
                          {"comm", e.comm}});
  }
  return j;
}

void print_samples(std::ostream& os, const nlohmann::json& samples) {
  os << "samples (global index: step, source, window start, documents the inputs meet):\n";
  for (const auto& w : samples) {
    os << "  " << w["index"].get<int64_t>() << ": step " << w["step"].get<int64_t>() << ", source "
       << w["source"].get<int64_t>() << " (" << w["path"].get<std::string>() << "), tokens from "
       << w["start"].get<int64_t>();
    if (w.contains("documents")) os << ", " << w["documents"].get<int64_t>() << " document(s)";
    os << "\n";
  }
}

}  // namespace composer
