#include "runner/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "parallelisms/collectives.h"
#include "runner/errors.h"

namespace composer {

NamedTensors snapshot_params(models::Model& model) {
  NamedTensors out;
  for (auto& [name, p] : nn::unique_named_parameters(model)) out.emplace_back(name, p.detach().clone());
  return out;
}

void load_weights(models::Model& model, const std::string& path) {
  auto tensors = read_safetensors(path);
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) params.emplace(item.key(), item.value());
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : tensors) {
    auto it = params.find(name);
    if (it == params.end()) {
      throw FileError(path, "unexpected tensor '" + name + "': model " + model.type() +
                                " has no parameter of that name");
    }
    if (it->second.sizes() != t.sizes()) {
      throw FileError(path, "tensor '" + name + "' has shape " + c10::str(t.sizes()) + " but the model's is " +
                                c10::str(it->second.sizes()));
    }
    if (!t.is_floating_point()) throw FileError(path, "tensor '" + name + "' is not floating point");
    it->second.copy_(t);
    loaded.insert(name);
    // A tied weight is loaded under any of its names.
    for (auto& [other, q] : params) {
      if (q.unsafeGetTensorImpl() == it->second.unsafeGetTensorImpl()) loaded.insert(other);
    }
  }
  for (auto& [name, p] : params) {
    if (!loaded.count(name)) throw FileError(path, "missing tensor '" + name + "' that the model needs");
  }
}

void save_weights(models::Model& model, const std::string& path) {
  write_safetensors(path, snapshot_params(model), {{"format", "pt"}});
}

// ---- distributed checkpoints -------------------------------------------------

namespace {

namespace fs = std::filesystem;

constexpr const char* kIndex = "index.json";
constexpr const char* kStatePrefix = "optim.state.";

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

uint64_t fnv1a64(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

void fsync_path(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

// Writes `bytes` to `path` durably: a temporary file, fsync, rename, fsync of the folder.
void write_synced(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) throw RuntimeFailure("cannot write " + tmp + " (disk full or not writable?)");
  }
  fsync_path(tmp, O_RDONLY);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw RuntimeFailure("cannot rename " + tmp + " to " + path);
  fsync_path(fs::path(path).parent_path().string(), O_RDONLY | O_DIRECTORY);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot read the file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One local tensor a checkpoint holds: a parameter or one of its optimizer
// states, this rank's piece of it and where that piece lies.
struct Piece {
  std::string key;
  torch::Tensor local;  // shaped as the box
  std::vector<int64_t> global;
  parallel::Box box;
  bool owner = false;  // this rank writes it
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
    std::vector<std::string> keys{hp.name};
    for (const auto& s : opt.state_names()) keys.push_back(kStatePrefix + hp.name + "." + s);
    known.insert(keys.begin(), keys.end());
    if (hp.spec && !hp.spec->held()) continue;
    Piece base;
    base.global = hp.spec ? hp.spec->global_shape : shape_of(hp.param);
    base.box = hp.spec ? hp.spec->box() : parallel::Box{std::vector<int64_t>(base.global.size(), 0), base.global};
    base.owner = hp.spec ? hp.spec->counts() : rank == 0;
    base.key = hp.name;
    base.local = hp.param.detach().view(base.box.size);
    out.push_back(base);
    Optimizer::State* st = restore ? &opt.restore_state_of(hp.param, step) : opt.state_of(hp.param);
    for (const auto& s : opt.state_names()) {
      if (!st) break;
      torch::Tensor& t = st->tensors[s];
      if (restore) t = torch::zeros_like(hp.param);
      if (!t.defined()) continue;
      Piece piece = base;
      piece.key = kStatePrefix + hp.name + "." + s;
      piece.local = t.view(base.box.size);
      out.push_back(piece);
    }
  }
  return out;
}

}  // namespace

Checkpointer::Checkpointer(const ExperimentConfig& c, const std::string& out_dir, int rank, parallel::Group* world)
    : c_(c), dir_(c.checkpoint.dir.empty() ? out_dir + "/checkpoints" : c.checkpoint.dir), rank_(rank), world_(world) {}

std::string Checkpointer::resume_path() const {
  const std::string& r = c_.checkpoint.resume;
  if (r == "never") return "";
  if (r != "auto") {
    if (!fs::exists(fs::path(r) / kIndex)) {
      throw ConfigError(c_.checkpoint.resume_ref, r + " is not a complete checkpoint (no index.json in it); give a "
                                                      "step-N folder that has one, auto or never");
    }
    return r;
  }
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

void Checkpointer::save(int64_t step, const std::vector<HeldParam>& params, Optimizer& opt) {
  const std::string folder = (fs::path(dir_) / step_folder(step)).string();
  fs::create_directories(folder);
  std::set<std::string> known;
  NamedTensors mine;
  nlohmann::json offsets = nlohmann::json::object(), global = nlohmann::json::object();
  for (auto& p : pieces_of(params, opt, rank_, false, 0, known)) {
    if (!p.owner) continue;
    mine.emplace_back(p.key, p.local);
    offsets[p.key] = p.box.offset;
    global[p.key] = p.global;
  }
  mine.emplace_back("rng", at::detail::getDefaultCPUGenerator().get_state());
  const std::string bytes = serialize_safetensors(
      mine, {{"format", "composer-checkpoint-rank"}, {"offsets", offsets.dump()}, {"global_shapes", global.dump()}});
  write_synced(folder + "/" + rank_file(rank_), bytes);
  // Every rank's file hash reaches rank 0; the collective is also the barrier
  // after which every file is on disk.
  const int64_t world = world_ ? world_->size : 1;
  auto hashes = torch::zeros({world}, torch::kLong);
  hashes[rank_] = static_cast<int64_t>(fnv1a64(bytes));
  if (world_) parallel::all_reduce(*world_, hashes);
  if (rank_ != 0) return;

  nlohmann::json files = nlohmann::json::array(), tensors = nlohmann::json::object();
  for (int64_t r = 0; r < world; ++r) {
    const std::string name = rank_file(r);
    files.push_back({{"name", name}, {"fnv1a64", hex64(static_cast<uint64_t>(hashes[r].item<int64_t>()))}});
    const nlohmann::json header = read_safetensors_header(folder + "/" + name);
    const auto meta = header.value("__metadata__", nlohmann::json::object());
    const auto offs = nlohmann::json::parse(meta.value("offsets", std::string("{}")));
    const auto shapes = nlohmann::json::parse(meta.value("global_shapes", std::string("{}")));
    for (const auto& item : header.items()) {
      if (item.key() == "__metadata__" || item.key() == "rng") continue;
      auto& entry = tensors[item.key()];
      entry["dtype"] = item.value()["dtype"];
      entry["shape"] = shapes.at(item.key());
      entry["chunks"].push_back({{"file", name}, {"offset", offs.at(item.key())}, {"size", item.value()["shape"]}});
    }
  }
  const nlohmann::json resolved = to_json(c_);
  nlohmann::json index = {
      {"format", "composer-checkpoint"},
      {"version", 1},
      {"step", step},
      {"samples_seen", step * c_.train.global_batch},
      {"world_size", world},
      {"config_hash", config_hash(c_)},
      {"plan", {{"mesh", resolved["mesh"]}, {"parallelize", resolved["parallelize"]}}},
      {"optimizer", {{"config", resolved["train"]["optimizer"]}, {"steps", opt.steps()}}},
      {"lr_schedule", {{"config", resolved["train"]["lr_schedule"]}, {"position", step}}},
      {"files", files},
      {"tensors", tensors}};
  write_synced(folder + "/" + kIndex, index.dump(1));

  // Keep the newest keep_latest_k complete checkpoints; drop older ones and
  // incomplete folders older than the newest complete one (a crash's leftovers).
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
  const std::string index_path = (fs::path(path) / kIndex).string();
  const CheckpointIndex index = parse_checkpoint_index(read_text(index_path), index_path);
  if (index.config_hash != config_hash(c_)) {
    throw ConfigError(c_.checkpoint.resume_ref,
                      path + " was saved by a config with another seed, model, train or data section (hash " +
                          index.config_hash + ", this config's " + config_hash(c_) +
                          "); resume with the config that saved it, or set checkpoint.resume: never");
  }
  std::set<std::string> known;
  std::vector<Piece> pieces = pieces_of(params, opt, rank_, true, static_cast<double>(index.step), known);
  for (const auto& [key, e] : index.tensors) {
    if (!known.count(key)) {
      throw FileError(index_path, "unexpected tensor '" + key + "': the model has no parameter or optimizer state of "
                                  "that name (another model or optimizer saved it)");
    }
  }
  std::map<std::string, std::map<std::string, torch::Tensor>> files;  // read on first use, hash checked
  auto file = [&](const std::string& name) -> std::map<std::string, torch::Tensor>& {
    auto it = files.find(name);
    if (it != files.end()) return it->second;
    const std::string p = (fs::path(path) / name).string();
    const std::string bytes = read_text(p);
    if (hex64(fnv1a64(bytes)) != index.file_hashes.at(name)) {
      throw FileError(p, "its hash differs from the one index.json records: the file is damaged or was replaced");
    }
    auto& out = files[name];
    for (auto& [k, t] : parse_safetensors(bytes, p)) out[k] = t;
    return out;
  };
  torch::NoGradGuard no_grad;
  for (auto& piece : pieces) {
    auto it = index.tensors.find(piece.key);
    if (it == index.tensors.end()) {
      throw FileError(index_path, "missing tensor '" + piece.key + "' that the model or optimizer needs");
    }
    const auto& e = it->second;
    if (e.shape != piece.global) {
      throw FileError(index_path, "tensor '" + piece.key + "' has shape " + c10::str(e.shape) +
                                      " but the model's is " + c10::str(piece.global));
    }
    int64_t covered = 0;
    for (const auto& ch : e.chunks) {
      torch::Tensor dst = piece.local, src;
      int64_t n = 1;
      for (size_t d = 0; d < e.shape.size() && n > 0; ++d) {
        const int64_t lo = std::max(piece.box.offset[d], ch.offset[d]);
        const int64_t hi = std::min(piece.box.offset[d] + piece.box.size[d], ch.offset[d] + ch.size[d]);
        n *= std::max<int64_t>(0, hi - lo);
      }
      if (n == 0) continue;
      auto& tensors = file(ch.file);
      auto t = tensors.find(piece.key);
      if (t == tensors.end() || t->second.sizes().vec() != ch.size) {
        throw FileError((fs::path(path) / ch.file).string(), "has no tensor '" + piece.key + "' of the size index.json records");
      }
      src = t->second;
      for (size_t d = 0; d < e.shape.size(); ++d) {
        const int64_t lo = std::max(piece.box.offset[d], ch.offset[d]);
        const int64_t hi = std::min(piece.box.offset[d] + piece.box.size[d], ch.offset[d] + ch.size[d]);
        dst = dst.narrow(static_cast<int64_t>(d), lo - piece.box.offset[d], hi - lo);
        src = src.narrow(static_cast<int64_t>(d), lo - ch.offset[d], hi - lo);
      }
      dst.copy_(src);
      covered += n;
    }
    if (covered != piece.local.numel()) {
      throw FileError(index_path, "the chunks of '" + piece.key + "' cover " + std::to_string(covered) + " of the " +
                                      std::to_string(piece.local.numel()) + " elements this rank needs");
    }
  }
  // The RNG: this rank's own when the job has the same ranks and plan, else rank 0's.
  const nlohmann::json resolved = to_json(c_);
  const bool same = index.world_size == (world_ ? world_->size : 1) &&
                    index.plan == nlohmann::json{{"mesh", resolved["mesh"]}, {"parallelize", resolved["parallelize"]}};
  auto& rng_file = file(rank_file(same ? rank_ : 0));
  auto rng = rng_file.find("rng");
  if (rng == rng_file.end()) throw FileError(path, "a rank file has no rng state");
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(rng->second);
  opt.set_steps(index.step);
  return index.step;
}

}  // namespace composer
