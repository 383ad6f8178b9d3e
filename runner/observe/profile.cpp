#include "runner/observe/profile.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "parallelisms/comm/trace_span.h"
#include "runner/base/errors.h"

namespace composer {
namespace {

namespace prof = torch::profiler::impl;

// The span each rank records right after the barrier that starts profiling.
constexpr const char* kClockSync = "clock sync";

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}

prof::ProfilerConfig config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

}  // namespace

StepProfiler::StepProfiler(const ProfileConfig& c, const std::string& out_dir, int rank, int world_size, bool cuda,
                           std::function<void()> barrier)
    : cuda_(cuda), rank_(rank), world_(world_size), barrier_(std::move(barrier)) {
  if (c.steps.size() != 2) return;
  first_ = c.steps[0];
  last_ = c.steps[1];
  dir_ = c.dir.empty() ? out_dir + "/profile" : c.dir;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw FileError(dir_, "cannot create the profile folder: " + ec.message() + "; check profile.dir");
  path_ = dir_ + "/kineto.rank" + std::to_string(rank) + ".json";
  if (rank == 0) merged_ = dir_ + "/trace.json";
  // A CUDA build of Kineto asks for GPUs even when it records only the CPU,
  // and logs the failure as an error; a cpu run silences it (unless
  // KINETO_LOG_LEVEL is set).
  if (!cuda) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  // Kineto's setup (and CUPTI's) before the timed steps.
  torch::autograd::profiler::prepareProfiler(config(), activities(cuda_));
}

StepProfiler::~StepProfiler() {  // a run stopped inside the range: no trace
  mark_.reset();
  if (on_) torch::autograd::profiler::disableProfiler();
}

void StepProfiler::begin_step(int64_t step) {
  if (step < first_ || step > last_) return;
  if (!on_) {  // the first chosen step, or the first after a resume inside the range
    torch::autograd::profiler::enableProfiler(config(), activities(cuda_));
    on_ = true;
    barrier_();  // every rank leaves it at about the same moment: the merge aligns the clocks there
    parallel::TraceSpan sync([] { return std::string(kClockSync); });
  }
  mark_name_ = "step " + std::to_string(step);
  mark_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  mark_->before(std::string_view(mark_name_), c10::ArrayRef<const c10::IValue>{});
}

void StepProfiler::end_step(int64_t step) {
  if (step < first_ || step > last_) return;
  mark_.reset();  // ends the annotation
  if (step != last_) return;
  on_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const std::string tmp = path_ + ".tmp";
  result->save(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) throw FileError(path_, "cannot write the profiler's trace: " + ec.message());
  barrier_();  // every rank's file is written
  if (rank_ != 0) return;
  try {
    merge_traces(dir_, world_, merged_);
  } catch (const std::exception& e) {  // e.g. ranks on other machines wrote to their own disks
    std::cerr << "profile: no merged trace (" << e.what() << "); each rank's own trace is kineto.rank<R>.json\n";
    merged_.clear();
  }
}

namespace {

bool is_collective(const std::string& name) {
  for (const char* kind : {"all_reduce ", "broadcast ", "all_gather ", "reduce_scatter ", "send ", "recv "}) {
    if (name.rfind(kind, 0) == 0) return true;
  }
  return false;
}

// Where one rank's trace goes in the merged one: its clock at the barrier,
// its host process and training thread in its own file, the threads that ran
// its collectives, and the merged trace's process ids for its host and device.
struct RankTrace {
  int rank = 0;
  int host = 0, device = 1;
  double sync = 0;
  nlohmann::json host_pid, main_tid;
  std::set<nlohmann::json> comm_threads;
};

// Rank r's trace at `path`, read whole.
nlohmann::json read_trace(const std::string& path, int r) {
  std::ifstream in(path);
  if (!in) throw FileError(path, "cannot read rank " + std::to_string(r) + "'s trace to merge it");
  return nlohmann::json::parse(in);
}

// The rank's place: its clock-sync span and the threads its collectives ran on.
RankTrace place_of(const nlohmann::json& evs, int r, const std::string& path) {
  RankTrace t;
  t.rank = r;
  t.host = 2 * r;
  t.device = 2 * r + 1;
  for (const auto& e : evs) {
    if (e.value("name", "") == kClockSync) {
      t.sync = e["ts"].get<double>();
      t.host_pid = e["pid"];
      t.main_tid = e["tid"];
      break;
    }
  }
  if (t.host_pid.is_null()) throw FileError(path, "has no clock-sync mark; was it written by this composer?");
  for (const auto& e : evs) {
    if (e.value("ph", "") == "X" && e["pid"] == t.host_pid && is_collective(e.value("name", ""))) {
      t.comm_threads.insert(e["tid"]);
    }
  }
  return t;
}

// "all_gather dp 1048576 B": the collective's kind, group and bytes as args.
void name_collective(nlohmann::json& e) {
  const std::string name = e["name"];
  const auto a = name.find(' '), b = name.rfind(' ', name.size() - 3);
  e["cat"] = "collective";
  e["args"]["kind"] = name.substr(0, a);
  e["args"]["group"] = name.substr(a + 1, b - a - 1);
  e["args"]["bytes"] = std::stoll(name.substr(b + 1));
}

// Moves the rank's host and device events into `events`, on the merged
// clock (`shift` from the rank's) and process ids; returns whether any ran on
// the device. The profiler's own spans of its session are left out.
bool move_events(nlohmann::json& evs, const RankTrace& t, double shift, nlohmann::json& events) {
  bool has_device = false;
  for (auto& e : evs) {
    const std::string ph = e.value("ph", "");
    if (ph == "M" && e.value("name", "") != "thread_name") continue;  // process names are given below
    const bool on_host = e["pid"] == t.host_pid;
    const std::string cat = e.value("cat", "");
    const bool on_device = cat == "kernel" || cat.rfind("gpu_", 0) == 0;
    if (!on_host && !on_device && ph != "M") continue;
    if (on_device) has_device = true;
    e["pid"] = on_host ? t.host : t.device;
    if (e.contains("ts") && e["ts"].is_number()) e["ts"] = e["ts"].get<double>() + shift;
    if ((ph == "s" || ph == "f") && e.contains("id")) {
      e["id"] = static_cast<int64_t>(t.rank) * 1000000000 + e["id"].get<int64_t>();
    }
    if (ph == "X" && on_host && is_collective(e.value("name", ""))) name_collective(e);
    if (ph == "M" && on_host) {  // the threads by their role
      if (e["tid"] == t.main_tid) {
        e["args"]["name"] = "compute (training thread)";
      } else if (t.comm_threads.count(e["tid"])) {
        e["args"]["name"] = "communication";
      }
    }
    events.push_back(std::move(e));
  }
  return has_device;
}

// The rank's threads and processes by name, in rank order.
void name_rank(const RankTrace& t, bool has_device, nlohmann::json& events) {
  const int host = t.host, device = t.device;
  for (const auto& tid : t.comm_threads) {
    if (tid == t.main_tid) continue;
    events.push_back(
        {{"ph", "M"}, {"name", "thread_name"}, {"pid", host}, {"tid", tid}, {"args", {{"name", "communication"}}}});
  }
  events.push_back({{"ph", "M"},
                    {"name", "thread_name"},
                    {"pid", host},
                    {"tid", t.main_tid},
                    {"args", {{"name", "compute (training thread)"}}}});
  events.push_back(
      {{"ph", "M"}, {"name", "process_name"}, {"pid", host}, {"args", {{"name", "rank " + std::to_string(t.rank)}}}});
  events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", host}, {"args", {{"sort_index", host}}}});
  if (has_device) {
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", device},
                      {"args", {{"name", "rank " + std::to_string(t.rank) + " device"}}}});
    events.push_back(
        {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", device}, {"args", {{"sort_index", device}}}});
  }
}

// Writes the merged trace through a temporary file, so a reader never sees half of it.
void write_trace(const std::string& out, nlohmann::json events) {
  const std::string tmp = out + ".tmp";
  {
    std::ofstream o(tmp);
    o << nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
    if (!o) throw FileError(out, "cannot write the merged trace");
  }
  std::filesystem::rename(tmp, out);
}

}  // namespace

int64_t merge_traces(const std::string& dir, int world_size, const std::string& out) {
  nlohmann::json events = nlohmann::json::array();
  double sync0 = 0;
  for (int r = 0; r < world_size; ++r) {
    const std::string path = dir + "/kineto.rank" + std::to_string(r) + ".json";
    nlohmann::json trace = read_trace(path, r);
    auto& evs = trace["traceEvents"];
    const RankTrace t = place_of(evs, r, path);
    if (r == 0) sync0 = t.sync;
    const bool has_device = move_events(evs, t, sync0 - t.sync, events);
    name_rank(t, has_device, events);
  }
  const int64_t n = static_cast<int64_t>(events.size());
  write_trace(out, std::move(events));
  return n;
}

}  // namespace composer
