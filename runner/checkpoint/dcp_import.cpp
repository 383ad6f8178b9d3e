#include "runner/checkpoint/dcp_import.h"

#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "runner/base/errors.h"
#include "runner/base/python_tool.h"
#include "runner/base/safetensors.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/checkpoint/rank_file.h"

namespace composer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kPrefix = "checkpoint.resume_from_dcp: ";

std::string last_lines(const std::string& path, int n) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) {
    if (!l.empty()) lines.push_back(l);
  }
  std::string out;
  for (size_t i = lines.size() > static_cast<size_t>(n) ? lines.size() - n : 0; i < lines.size(); ++i) {
    out += (out.empty() ? "" : " | ") + lines[i];
  }
  return out;
}

bool starts(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

std::string ends_of(const std::string& s) {
  const size_t dot = s.rfind('.');
  return dot == std::string::npos ? s : s.substr(dot + 1);
}

// What composer does not take of the folder, line by line: the non-tensor entries grouped as torchtitan keeps them.
void report(const nlohmann::json& manifest, const ExperimentConfig& c, int64_t step) {
  const std::string prefix = kPrefix;
  for (const auto& n : manifest.value("computed", nlohmann::json::array())) {
    std::cout << prefix << "not taken: " << n.get<std::string>() << ": composer computes it from model.args\n";
  }
  const auto renamed = manifest.value("renamed", nlohmann::json::object());
  if (!renamed.empty()) {
    std::cout << prefix << renamed.size() << " tensors renamed from torchtitan's names (e.g. " << renamed.begin().key()
              << " -> " << renamed.begin().value().get<std::string>() << ")\n";
  }
  std::map<std::string, std::set<std::string>> groups;  // optimizer.param_groups: key -> distinct values
  std::vector<std::string> loader, other;
  std::string schedule;
  for (const auto& [name, v] : manifest.at("objects").items()) {
    const std::string shown = v.contains("value") ? v["value"].dump() : v.value("type", std::string("?"));
    if (starts(name, "optimizer.param_groups.")) {
      groups[ends_of(name)].insert(shown);
    } else if (starts(name, "dataloader.")) {
      loader.push_back(name);
    } else if (name == "lr_scheduler.last_epoch") {
      schedule = shown;
    } else if (!starts(name, "lr_scheduler.")) {
      other.push_back(name + " " + shown);
    }
  }
  if (!groups.empty()) {
    std::string line;
    for (const auto& [key, values] : groups) {
      if (key == "params" || key == "param_names") continue;
      std::string vs;
      for (const auto& x : values) vs += (vs.empty() ? "" : " or ") + x;
      line += (line.empty() ? "" : ", ") + key + " " + vs;
    }
    std::cout << prefix << "not taken: optimizer.param_groups (" << line << "): composer's train.optimizer applies\n";
  }
  if (!schedule.empty()) {
    std::cout << prefix << "not taken: lr_scheduler (last_epoch " << schedule << "): composer's train.lr_schedule goes "
              << "on at step " << step << (schedule == std::to_string(step) ? "" : " (the scheduler's count differs)")
              << "\n";
  }
  if (!loader.empty()) {
    std::string names;
    for (const auto& n : loader) names += (names.empty() ? "" : ", ") + n;
    std::cout << prefix << "not taken: " << names << ": composer's data goes on from sample " << step * c.train.global_batch
              << " (step " << step << " x train.global_batch) in its own order\n";
  }
  for (const auto& o : other) std::cout << prefix << "not taken: " << o << "\n";
}

// tools/dcp_import.py reads checkpoint.resume_from_dcp into `staging`: the parts and their manifest.
nlohmann::json read_with_pytorch(const ExperimentConfig& c, const std::string& staging) {
  const std::string& from = c.checkpoint.resume_from_dcp;
  fs::remove_all(staging);
  fs::create_directories(staging);
  const std::string log = staging + "/log.txt";
  std::cout << kPrefix << "reading " << from << " with PyTorch (tools/dcp_import.py)" << std::endl;
  const int rc = run_python_tool("dcp_import.py", {"--dcp", from, "--out", staging, "--model", c.model.name}, log);
  if (rc == 2) throw ConfigError(c.checkpoint.resume_from_dcp_ref, "cannot import " + from + ": " + last_lines(log, 2));
  if (rc != 0) {
    throw RuntimeFailure("tools/dcp_import.py failed on " + from + " (exit " + std::to_string(rc) + "): " +
                         last_lines(log, 3) + "; the whole output is in " + log);
  }
  try {
    std::ifstream in(staging + "/manifest.json");
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw RuntimeFailure(staging + "/manifest.json: " + e.what());
  }
}

// The parts in `staging` as the rank files and index of the checkpoint of the manifest's step.
std::string write_checkpoint(Checkpointer& ck, const ExperimentConfig& c, const std::string& staging,
                             const nlohmann::json& manifest) {
  const int64_t step = manifest.at("step").get<int64_t>();
  const auto files = manifest.at("files").get<std::vector<std::string>>();
  // The RNG state a fresh run of this seed starts with, in every file (DCP holds no composer RNG state).
  const torch::Tensor rng = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(c.seed)).get_state();
  return ck.save_files(step, step, static_cast<int64_t>(files.size()), [&](int64_t k) {
    RankSnapshot s;
    for (auto& [name, t] : read_safetensors(staging + "/" + files[k])) {
      s.offsets[name] = std::vector<int64_t>(t.dim(), 0);
      s.global[name] = t.sizes().vec();
      s.tensors.emplace_back(name, t.contiguous());
    }
    s.tensors.emplace_back("rng", rng);
    s.offsets["rng"] = {k * rng.numel()};
    return s;
  });
}

}  // namespace

std::string import_dcp_if_needed(const ExperimentConfig& c, const std::string& out_dir) {
  const std::string& from = c.checkpoint.resume_from_dcp;
  if (from.empty() || !c.checkpoint.enabled) return "";
  Checkpointer ck(c, out_dir, 0, nullptr);
  const std::string newest = ck.resume_path();
  if (!newest.empty()) {
    std::cout << kPrefix << from << " not read: " << newest << " is composer's newest checkpoint of this run; "
              << "resuming it\n";
    return "";
  }
  if (!fs::is_regular_file(fs::path(from) / ".metadata")) {
    throw ConfigError(c.checkpoint.resume_from_dcp_ref,
                      from + " is not a PyTorch Distributed Checkpoint folder (it has no .metadata); give the step-N "
                             "folder that dcp.save wrote (torchtitan: <dump_folder>/checkpoint/step-N)");
  }
  const std::string staging = (fs::path(ck.dir()) / "dcp-import.tmp").string();
  const nlohmann::json manifest = read_with_pytorch(c, staging);
  const int64_t step = manifest.at("step").get<int64_t>();
  const std::string folder = write_checkpoint(ck, c, staging, manifest);
  std::cout << kPrefix << from << " (step " << step << ", " << manifest.at("tensors").size() << " tensors) is now "
            << folder << "\n";
  report(manifest, c, step);
  fs::remove_all(staging);
  return folder;
}

}  // namespace composer
