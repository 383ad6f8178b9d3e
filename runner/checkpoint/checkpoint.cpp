#include "runner/checkpoint/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "parallelisms/comm/collectives.h"
#include "runner/checkpoint/checkpoint_reader.h"
#include "runner/checkpoint/rank_file.h"
#include "runner/checkpoint/weight_source.h"
#include "runner/launch/rank.h"
#include "runner/base/errors.h"

namespace composer {

NamedTensors snapshot_params(models::Model& model) {
  NamedTensors out;
  for (auto& [name, p] : nn::unique_named_parameters(model)) out.emplace_back(name, p.detach().clone());
  for (auto& [name, b] : nn::named_weight_buffers(model)) out.emplace_back(name, b.detach().clone());
  return out;
}

void load_weights(models::Model& model, const std::string& path) { load_weights(model, *WeightSource::file(path)); }

void check_resumable(const ExperimentConfig& c, const std::string& path) {
  CheckpointReader reader(path);
  const CheckpointIndex& index = reader.index();
  // Another train.steps alone continues the run (the schedule's horizon becomes this config's steps).
  const bool longer = !index.resume_hash.empty() && index.resume_hash == resume_hash(c);
  if (index.config_hash != config_hash(c) && !longer) {
    throw ConfigError(c.checkpoint.resume_ref,
                      path + " was saved by a config with another seed, model, train or data section (hash " +
                          index.config_hash + ", this config's " + config_hash(c) +
                          "); resume with the config that saved it, or set checkpoint.resume: never");
  }
}

void save_weights(models::Model& model, const std::string& path) {
  write_safetensors(path, snapshot_params(model), {{"format", "pt"}});
}

bool saves_trained_only(const ExperimentConfig& c) { return c.train.lora || !c.train.freeze.empty(); }

nlohmann::json frozen_base(const ExperimentConfig& c) {
  if (!saves_trained_only(c)) return nullptr;
  const std::string hash = start_weights_hash(c.model);
  if (hash.empty()) return {{"drawn_from_seed", c.seed}};
  return {{c.model.from_hf.empty() ? "init_from" : "from_hf",
           c.model.from_hf.empty() ? c.model.init_from : c.model.from_hf},
          {"content_fnv1a64", hash}};
}

void check_frozen_base(const ExperimentConfig& c, const std::string& path) {
  CheckpointReader reader(path);
  const nlohmann::json& saved = reader.index().frozen_base;
  if (saved.is_null() || !saved.contains("content_fnv1a64")) return;  // every parameter saved, or drawn (config hash)
  const std::string now = start_weights_hash(c.model);
  if (now == saved["content_fnv1a64"]) return;
  const bool hf = !c.model.from_hf.empty();
  throw ConfigError(hf ? c.model.from_hf_ref : c.model.init_from_ref,
                    path + " holds only the parameters that train; its frozen ones came from " + saved.dump() +
                        ", and " + (hf ? c.model.from_hf : c.model.init_from) + " now holds other weights (content " +
                        "hash " + (now.empty() ? std::string("none") : now) + "); give the weights the run started " +
                        "from");
}

// ---- distributed checkpoints -------------------------------------------------

namespace {

namespace fs = std::filesystem;

constexpr const char* kIndex = "index.json";
// Optimizer state keys are torchtitan's (`optimizer.state.<fqn>.<name>`, as DCP
// flattens get_optimizer_state_dict's), so that PyTorch's HuggingFaceStorageReader
// loads a step folder into a torchtitan-shaped state dict (docs/checkpoints.md#pytorch-dcp).
constexpr const char* kStatePrefix = "optimizer.state.";

// The Adam family's state keeps a `step` per parameter in PyTorch; composer's
// count is the optimizer's. A parameter with Adam moments gets a 0-d float32
// `optimizer.state.<fqn>.step` in the file of the rank holding its first piece,
// for PyTorch's loaders; composer's own load takes the count from the index.
bool keeps_step(const std::vector<std::string>& states) {
  return std::find(states.begin(), states.end(), "exp_avg") != states.end();  // Piece::step_of's state
}
std::string step_key(const std::string& fqn) { return kStatePrefix + fqn + ".step"; }

std::string step_folder(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%06lld", static_cast<long long>(step));
  return b;
}

std::string rank_file(int64_t r) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05lld.safetensors", static_cast<long long>(r));
  return b;
}

// The step of a folder named step-N; -1 for other names.
int64_t step_of(const fs::path& p) {
  const std::string n = p.filename().string();
  if (n.rfind("step-", 0) != 0 || n.size() == 5) return -1;
  for (size_t i = 5; i < n.size(); ++i) {
    if (n[i] < '0' || n[i] > '9') return -1;
  }
  return std::stoll(n.substr(5));
}


// The raw JSON header of a safetensors file.
std::string header_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8] = {};
  if (!in.read(reinterpret_cast<char*>(len), 8)) throw RuntimeFailure("cannot read " + path + " back");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  std::string h(n, '\0');
  if (!in.read(h.data(), static_cast<std::streamsize>(n))) throw RuntimeFailure("cannot read " + path + " back");
  return h;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One local tensor a checkpoint holds: a parameter or one of its optimizer
// states, this rank's piece of it and where that piece lies.
struct Piece {
  std::string key;
  torch::Tensor local;  // shaped as the box
  std::vector<int64_t> global;
  parallel::Box box;
  bool owner = false;  // this rank writes it
  std::string step_of;  // an Adam first moment: its parameter's name, whose step the rank at offset zero writes
};

std::vector<int64_t> shape_of(const torch::Tensor& t) {
  return t.dim() == 0 ? std::vector<int64_t>{1} : t.sizes().vec();
}

// The pieces of every held parameter and its optimizer state; `known` gets
// every key the model and optimizer have, held here or not. With `restore`,
// optimizer states are created (zeros, `step` updates) to be filled.
std::vector<Piece> pieces_of(const std::vector<HeldParam>& params, Optimizer& opt, int rank, bool restore,
                             double step, std::set<std::string>& known) {
  std::vector<Piece> out;
  for (const auto& hp : params) {
    // A buffer, or a parameter train.freeze keeps fixed, has no optimizer state.
    const bool trains = !hp.buffer && hp.param.requires_grad();
    std::vector<std::string> keys{hp.name};
    const std::vector<std::string> states = opt.state_names(hp.name, hp.param);
    for (const auto& s : states) {
      if (trains) keys.push_back(kStatePrefix + hp.name + "." + s);
    }
    if (trains && keeps_step(states)) keys.push_back(step_key(hp.name));
    known.insert(keys.begin(), keys.end());
    if (hp.spec && !hp.spec->held()) continue;
    Piece base;
    base.global = hp.spec && !hp.spec->global_shape.empty() ? hp.spec->global_shape : shape_of(hp.param);
    base.box = hp.spec ? hp.spec->box() : parallel::Box{std::vector<int64_t>(base.global.size(), 0), base.global};
    base.owner = hp.spec ? hp.spec->counts() : rank == 0;
    base.key = hp.name;
    base.local = hp.param.detach().view(base.box.size);
    out.push_back(base);
    if (!trains) continue;
    Optimizer::State* st = restore ? &opt.restore_state_of(hp.param, step) : opt.state_of(hp.param);
    for (const auto& s : opt.state_names(hp.name, hp.param)) {
      if (!st) break;
      torch::Tensor& t = st->tensors[s];
      if (restore) t = torch::zeros_like(hp.param);
      if (!t.defined()) continue;
      Piece piece = base;
      piece.key = kStatePrefix + hp.name + "." + s;
      piece.local = t.view(base.box.size);
      if (s == "exp_avg") piece.step_of = hp.name;
      out.push_back(piece);
    }
  }
  return out;
}

}  // namespace


namespace {

// With `copy` every tensor is a copy of its own (pinned host memory for a
// device tensor), so training may go on while it is written (checkpoint.async);
// without, host tensors are the live ones.
RankSnapshot snapshot_rank(const std::vector<HeldParam>& params, Optimizer& opt, int rank, bool copy) {
  std::set<std::string> known;
  RankSnapshot s;
  auto add = [&](const std::string& key, const torch::Tensor& t) {
    torch::Tensor d = t.detach();
    torch::Tensor c;
    if (copy && d.is_cuda()) {
      c = torch::empty(d.sizes(), d.options().device(torch::kCPU).pinned_memory(true));
      c.copy_(d);
    } else if (copy) {
      c = d.clone(at::MemoryFormat::Contiguous);
    } else {
      c = d.to(torch::kCPU).contiguous();
    }
    s.tensors.emplace_back(key, c);
  };
  std::set<std::string> stepped;  // the parameters whose Adam moments this rank writes from offset zero
  for (auto& p : pieces_of(params, opt, rank, false, 0, known)) {
    if (!p.owner) continue;
    add(p.key, p.local);
    s.offsets[p.key] = p.box.offset;
    s.global[p.key] = p.global;
    const bool first = std::all_of(p.box.offset.begin(), p.box.offset.end(), [](int64_t o) { return o == 0; });
    if (first && !p.step_of.empty()) stepped.insert(p.step_of);
  }
  for (const auto& fqn : stepped) {
    const std::string key = step_key(fqn);
    add(key, torch::tensor(static_cast<float>(opt.steps()), torch::kFloat32));
    s.offsets[key] = nlohmann::json::array();
    s.global[key] = nlohmann::json::array();
  }
  const torch::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
  add("rng", rng);
  // Every rank's RNG state, for DCP's sharding info: one [ranks x n] byte tensor, rank r's at r x n.
  s.offsets["rng"] = {static_cast<int64_t>(rank) * rng.numel()};
  return s;
}


}  // namespace

// What every rank reports of its file to rank 0 after writing it.
struct FileStats {
  torch::Tensor hashes;  // [world]: each rank file's hash
  torch::Tensor stats;   // [2, world]: bytes, seconds
};

namespace {

// Every rank's file hash, size and write time reach rank 0; the collective
// is also the barrier after which every file is on disk.
FileStats gather_file_stats(parallel::Group* world_group, int64_t world, int rank, const WrittenFile& file,
                            std::chrono::steady_clock::time_point start) {
  FileStats s;
  s.hashes = torch::zeros({world}, torch::kLong);
  s.stats = torch::zeros({2, world}, torch::kDouble);
  s.hashes[rank] = static_cast<int64_t>(file.hash);
  s.stats[0][rank] = static_cast<double>(file.bytes);
  s.stats[1][rank] = seconds_since(start);
  if (world_group) {
    parallel::all_reduce(*world_group, s.hashes);
    parallel::all_reduce(*world_group, s.stats);
  }
  return s;
}

// The files and tensors sections of a step's index.json.
struct Listing {
  nlohmann::json files = nlohmann::json::array(), tensors = nlohmann::json::object();
};

// Lists the rank files in `folder` for index.json, from their headers as written and the hashes every rank sent.
Listing list_rank_files(const std::string& folder, int64_t world, const torch::Tensor& file_hashes) {
  Listing l;
  for (int64_t r = 0; r < world; ++r) {
    const std::string name = rank_file(r);
    const std::string text = header_text(folder + "/" + name);
    const nlohmann::json header = nlohmann::json::parse(text);
    const auto meta = header.value("__metadata__", nlohmann::json::object());
    const auto offs = nlohmann::json::parse(meta.value("offsets", std::string("{}")));
    const auto shapes = nlohmann::json::parse(meta.value("global_shapes", std::string("{}")));
    const auto blocks = nlohmann::json::parse(meta.value("fnv1a64", std::string("{}")));
    l.files.push_back({{"name", name},
                       {"fnv1a64", hex64(static_cast<uint64_t>(file_hashes[r].item<int64_t>()))},
                       {"header_fnv1a64", hex64(fnv1a64(text.data(), text.size()))},
                       {"rng_fnv1a64", blocks.at("rng")}});
    for (const auto& item : header.items()) {
      if (item.key() == "__metadata__" || item.key() == "rng") continue;
      auto& entry = l.tensors[item.key()];
      entry["dtype"] = item.value()["dtype"];
      entry["shape"] = shapes.at(item.key());
      entry["chunks"].push_back({{"file", name},
                                 {"offset", offs.at(item.key())},
                                 {"size", item.value()["shape"]},
                                 {"fnv1a64", blocks.at(item.key())}});
    }
  }
  return l;
}

// The index.json of the checkpoint of `step`, whose rank files `listing` lists.
nlohmann::json index_json(const ExperimentConfig& c, int64_t step, int64_t world, int64_t optimizer_steps,
                          const Listing& listing, const nlohmann::json& base) {
  const nlohmann::json resolved = to_json(c);
  return {{"format", "composer-checkpoint"},
          {"version", 3},
          {"step", step},
          {"samples_seen", step * c.train.global_batch},
          {"world_size", world},
          {"config_hash", config_hash(c)},
          {"resume_hash", resume_hash(c)},
          {"train_steps", c.train.steps},
          {"plan", {{"mesh", resolved["mesh"]}, {"parallelize", resolved["parallelize"]}}},
          {"frozen_base", base},
          {"optimizer", {{"config", resolved["train"]["optimizer"]}, {"steps", optimizer_steps}}},
          {"lr_schedule", {{"config", resolved["train"]["lr_schedule"]}, {"position", step}}},
          {"hash_block_bytes", kHashBlockBytes},
          {"files", listing.files},
          {"tensors", listing.tensors}};
}

}  // namespace

// checkpoint.async: the save on its writer thread.
struct Checkpointer::InFlight {
  int64_t step = 0;
  std::thread thread;
  std::exception_ptr error;  // what the writer threw, for the training thread to rethrow
};

Checkpointer::Checkpointer(const ExperimentConfig& c, const std::string& out_dir, int rank, parallel::Group* world,
                           std::string log_prefix, c10::intrusive_ptr<c10d::Store> store, int attempt)
    : c_(c),
      dir_(c.checkpoint.dir.empty() ? out_dir + "/checkpoints" : c.checkpoint.dir),
      rank_(rank),
      world_(world),
      log_prefix_(std::move(log_prefix)),
      attempt_(attempt) {
  // The writer thread talks to the store over a connection of its own.
  if (store && c.checkpoint.async_save) {
    try {
      store_ = store->clone();
    } catch (const std::exception&) {
      store_ = store;
    }
  }
}

Checkpointer::~Checkpointer() {
  if (inflight_ && inflight_->thread.joinable()) inflight_->thread.join();
}

std::string Checkpointer::resume_path() const {
  const std::string& r = c_.checkpoint.resume;
  if (r == "never") return "";
  const std::string newest = newest_complete();
  if (attempt_ > 0 && !newest.empty()) return newest;  // a restart goes on from the newest save, not the given one
  if (r != "auto") {
    if (!fs::exists(fs::path(r) / kIndex)) {
      throw ConfigError(c_.checkpoint.resume_ref, r + " is not a complete checkpoint (no index.json in it); give a "
                                                      "step-N folder that has one, auto or never");
    }
    return r;
  }
  return newest;
}

std::string Checkpointer::newest_complete() const {
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return "";
  int64_t best = -1;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const int64_t s = step_of(e.path());
    if (s > best && fs::exists(e.path() / kIndex)) best = s;
  }
  return best < 0 ? "" : (fs::path(dir_) / step_folder(best)).string();
}

bool Checkpointer::due(int64_t step) const {
  const int64_t every = c_.checkpoint.interval;
  return step == c_.train.steps || (every > 0 && step % every == 0);
}

// debug.fail_at before_index: the rank fails between its file and the index.
void Checkpointer::fail_if_asked(int64_t step) const {
  const DebugConfig& d = c_.debug;
  if (d.fail_at == FailAt::kBeforeIndex && d.fail_rank == rank_ && d.fail_step == step &&
      attempt_ < d.fail_attempts) {
    fail_on_purpose(d, rank_, "after writing " + rank_file(rank_) + " of step " + std::to_string(step) +
                                  ", before its index.json");
  }
}

void Checkpointer::save(int64_t step, const std::vector<HeldParam>& params, Optimizer& opt) {
  if (c_.checkpoint.async_save) return save_async(step, params, opt);
  const auto start = std::chrono::steady_clock::now();
  const std::string folder = (fs::path(dir_) / step_folder(step)).string();
  fs::create_directories(folder);
  const WrittenFile file = write_rank_file(folder + "/" + rank_file(rank_), snapshot_rank(params, opt, rank_, false));
  fail_if_asked(step);
  const int64_t world = world_ ? world_->size : 1;
  const FileStats reported = gather_file_stats(world_, world, rank_, file, start);
  if (rank_ == 0) write_index(step, opt.steps(), reported);
}

std::string Checkpointer::save_files(int64_t step, int64_t optimizer_steps, int64_t files,
                              const std::function<RankSnapshot(int64_t)>& file) {
  const auto start = std::chrono::steady_clock::now();
  const std::string folder = (fs::path(dir_) / step_folder(step)).string();
  fs::create_directories(folder);
  FileStats reported;
  reported.hashes = torch::zeros({files}, torch::kLong);
  reported.stats = torch::zeros({2, files}, torch::kDouble);
  for (int64_t k = 0; k < files; ++k) {
    const WrittenFile w = write_rank_file(folder + "/" + rank_file(k), file(k));
    reported.hashes[k] = static_cast<int64_t>(w.hash);
    reported.stats[0][k] = static_cast<double>(w.bytes);
    reported.stats[1][k] = seconds_since(start);
  }
  write_index(step, optimizer_steps, reported);
  return folder;
}

// Rank 0, once every rank's file of `step` is on disk: the index, the log line, the pruning.
void Checkpointer::write_index(int64_t step, int64_t optimizer_steps, const FileStats& reported) const {
  const std::string folder = (fs::path(dir_) / step_folder(step)).string();
  const int64_t world = reported.hashes.size(0);
  const Listing listing = list_rank_files(folder, world, reported.hashes);
  if (!frozen_base_) frozen_base_ = frozen_base(c_);  // hashed once a run
  const nlohmann::json index = index_json(c_, step, world, optimizer_steps, listing, *frozen_base_);
  const std::string index_text = index.dump(1);
  write_synced(folder + "/" + kIndex, index_text);
  log_save(folder, index, reported.stats, static_cast<double>(index_text.size()));
  prune(step);
}

// checkpoint.async: the pieces are copied to host memory now (training waits
// for that only); a writer thread writes them, then reports its file through
// the rendezvous store, where rank 0's writer collects every rank's report
// before it writes the index. No collective runs off the training thread.
void Checkpointer::save_async(int64_t step, const std::vector<HeldParam>& params, Optimizer& opt) {
  finish();  // at most one save in flight
  const auto start = std::chrono::steady_clock::now();
  auto snap = std::make_shared<RankSnapshot>(snapshot_rank(params, opt, rank_, true));
  const double copy_ms = seconds_since(start) * 1e3;
  const int64_t optimizer_steps = opt.steps();
  const int64_t copied = snap->bytes();
  inflight_ = std::make_unique<InFlight>();
  inflight_->step = step;
  InFlight* job = inflight_.get();
  job->thread = std::thread([this, job, snap, step, optimizer_steps, start]() mutable {
    try {
      write_in_background(step, snap, optimizer_steps, start);
    } catch (...) {
      job->error = std::current_exception();
    }
  });
  if (rank_ == 0) {
    char line[200];
    std::snprintf(line, sizeof line, "checkpoint step %lld: %.3f MB copied to host memory in %.1f ms; written in the "
                  "background (checkpoint.async)", static_cast<long long>(step), static_cast<double>(copied) / 1e6,
                  copy_ms);
    std::cout << log_prefix_ << line << "\n";
  }
}

void Checkpointer::write_in_background(int64_t step, std::shared_ptr<RankSnapshot>& snap, int64_t optimizer_steps,
                                       std::chrono::steady_clock::time_point start) {
  const std::string folder = (fs::path(dir_) / step_folder(step)).string();
  fs::create_directories(folder);
  const WrittenFile file = write_rank_file(folder + "/" + rank_file(rank_), *snap);
  snap.reset();  // the host copy goes as soon as it is on disk
  fail_if_asked(step);
  const int64_t world = world_ ? world_->size : 1;
  FileStats reported;
  reported.hashes = torch::zeros({world}, torch::kLong);
  reported.stats = torch::zeros({2, world}, torch::kDouble);
  const auto key = [step](int64_t r) { return "composer/checkpoint/" + std::to_string(step) + "/" + std::to_string(r); };
  const double seconds = seconds_since(start);
  if (world > 1) {
    TORCH_CHECK(store_, "checkpoint.async needs the rendezvous store");
    std::ostringstream mine;
    mine << file.hash << " " << file.bytes << " " << seconds;
    store_->set(key(rank_), mine.str());
    if (rank_ != 0) return;
    for (int64_t r = 0; r < world; ++r) {
      store_->wait({key(r)});
      std::istringstream in(store_->get_to_str(key(r)));
      uint64_t hash = 0;
      double bytes = 0, secs = 0;
      in >> hash >> bytes >> secs;
      reported.hashes[r] = static_cast<int64_t>(hash);
      reported.stats[0][r] = bytes;
      reported.stats[1][r] = secs;
    }
  } else {
    reported.hashes[0] = static_cast<int64_t>(file.hash);
    reported.stats[0][0] = static_cast<double>(file.bytes);
    reported.stats[1][0] = seconds;
  }
  write_index(step, optimizer_steps, reported);
}

void Checkpointer::finish() {
  if (!inflight_) return;
  const auto start = std::chrono::steady_clock::now();
  inflight_->thread.join();
  const double waited_ms = seconds_since(start) * 1e3;
  std::unique_ptr<InFlight> done = std::move(inflight_);
  if (done->error) std::rethrow_exception(done->error);
  if (rank_ == 0 && waited_ms >= 1) {
    char line[200];
    std::snprintf(line, sizeof line, "checkpoint step %lld: waited %.1f ms for its background write to finish",
                  static_cast<long long>(done->step), waited_ms);
    std::cout << log_prefix_ << line << "\n";
  }
}

// Save figures: the payload against the ideal (every parameter and optimizer
// state once) and the write throughput of each rank (its bytes over its time
// to serialise, hash, write and sync them).
void Checkpointer::log_save(const std::string& folder, const nlohmann::json& index, const torch::Tensor& stats,
                            double index_bytes) const {
  double ideal = 0, on_disk = index_bytes, rate = 0;
  for (const auto& item : index["tensors"].items()) {
    double n = static_cast<double>(c10::elementSize(scalar_type_of_name(item.value()["dtype"].get<std::string>(), folder)));
    for (const auto& s : item.value()["shape"]) n *= s.get<double>();
    ideal += n;
  }
  const int64_t world = stats.size(1);
  double slowest = 0;
  for (int64_t r = 0; r < world; ++r) {
    on_disk += stats[0][r].item<double>();
    rate += stats[0][r].item<double>() / std::max(stats[1][r].item<double>(), 1e-9) / world;
    slowest = std::max(slowest, stats[1][r].item<double>());
  }
  char line[400];
  std::snprintf(line, sizeof line,
                "checkpoint saved %s: %.3f MB on disk in %lld rank files and index.json, ideal %.3f MB (parameters "
                "and optimizer state once; x%.4f); %.3f s, %.1f MB/s per rank",
                folder.c_str(), on_disk / 1e6, static_cast<long long>(world), ideal / 1e6, on_disk / ideal, slowest,
                rate / 1e6);
  std::cout << log_prefix_ << line << "\n";
}

// Keep the newest keep_latest_k complete checkpoints; drop older ones and
// incomplete folders older than the newest complete one (a crash's leftovers).
void Checkpointer::prune(int64_t step) const {
  std::vector<std::pair<int64_t, fs::path>> complete, partial;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const int64_t s = step_of(e.path());
    if (s < 0) continue;
    (fs::exists(e.path() / kIndex) ? complete : partial).emplace_back(s, e.path());
  }
  std::sort(complete.begin(), complete.end());
  const int64_t keep = c_.checkpoint.keep_latest_k;
  for (size_t i = 0; i + keep < complete.size(); ++i) fs::remove_all(complete[i].second);
  for (const auto& [s, path] : partial) {
    if (s < step) fs::remove_all(path);
  }
}

int64_t Checkpointer::load(const std::string& path, const std::vector<HeldParam>& params, Optimizer& opt) {
  const auto start = std::chrono::steady_clock::now();
  check_resumable(c_, path);
  CheckpointReader reader(path);
  const CheckpointIndex& index = reader.index();
  if (rank_ == 0 && index.train_steps > 0 && index.train_steps != c_.train.steps) {
    std::cout << log_prefix_ << "resuming step " << index.step << " of a run saved with train.steps "
              << index.train_steps << "; training on to " << c_.train.steps << " steps, with the learning-rate "
              << "schedule's horizon now " << c_.train.steps << " steps (a run that starts with "
              << c_.train.steps << " follows it from step 1)\n";
  }
  std::set<std::string> known;
  std::vector<Piece> pieces = pieces_of(params, opt, rank_, true, static_cast<double>(index.step), known);
  for (const auto& [key, e] : index.tensors) {
    if (!known.count(key)) {
      throw FileError(reader.index_path(), "unexpected tensor '" + key + "': the model has no parameter or optimizer "
                                           "state of that name (another model or optimizer saved it)");
    }
  }
  for (auto& piece : pieces) reader.read_box(piece.key, piece.global, piece.box, piece.local);
  // The RNG: this rank's own when the job has the same ranks and plan, else rank 0's.
  const nlohmann::json resolved = to_json(c_);
  const bool same = index.world_size == (world_ ? world_->size : 1) &&
                    index.plan == nlohmann::json{{"mesh", resolved["mesh"]}, {"parallelize", resolved["parallelize"]}};
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(reader.read_rng(rank_file(same ? rank_ : 0)));
  opt.set_steps(index.step);

  // Load figures: the bytes each rank read (headers and the hash blocks that
  // cover its rows) and its read rate.
  const int64_t world = world_ ? world_->size : 1;
  auto stats = torch::zeros({2, world}, torch::kDouble);
  stats[0][rank_] = static_cast<double>(reader.bytes_read());
  stats[1][rank_] = seconds_since(start);
  if (world_) parallel::all_reduce(*world_, stats);
  if (rank_ == 0) {
    double total = 0, rate = 0, slowest = 0;
    for (int64_t r = 0; r < world; ++r) {
      total += stats[0][r].item<double>();
      rate += stats[0][r].item<double>() / std::max(stats[1][r].item<double>(), 1e-9) / world;
      slowest = std::max(slowest, stats[1][r].item<double>());
    }
    char line[300];
    std::snprintf(line, sizeof line, "checkpoint loaded %s: %.3f MB read by %lld ranks; %.3f s, %.1f MB/s per rank",
                  path.c_str(), total / 1e6, static_cast<long long>(world), slowest, rate / 1e6);
    std::cout << log_prefix_ << line << "\n";
  }
  return index.step;
}

}  // namespace composer
