// The error channels of composer. User errors (bad config, bad plan, bad files)
// exit 2; a failed golden comparison exits 1; a failure while running exits 3.
// Only main() turns these into exit codes.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace composer {

// Where a value came from: a YAML position, or a --set override.
struct SourceRef {
  std::string file;      // config file path ("" when unknown)
  int line = 0;          // 1-based; 0 when unknown
  int col = 0;           // 1-based
  std::string path;      // YAML path, e.g. "parallelize[1].fully_shard.units"
  std::string override;  // non-empty when the value came from --set

  // "configs/x.yaml:14:5: train.steps" or "--set train.steps=0: train.steps".
  std::string where() const;
};

// Any error caused by the user's input; exit code 2.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Malformed YAML, unknown key, wrong type, out-of-range value.
class ConfigError : public UserError {
 public:
  ConfigError(const SourceRef& ref, const std::string& message)
      : UserError(ref.where() + ": " + message), ref_(ref), message_(message) {}
  const SourceRef& ref() const { return ref_; }
  const std::string& message() const { return message_; }  // without the place

 private:
  SourceRef ref_;
  std::string message_;
};

// A plan that cannot run: divisibility, order, unsupported composition.
class PlanError : public UserError {
 public:
  PlanError(const SourceRef& ref, const std::string& message)
      : UserError(ref.where() + ": " + message), ref_(ref), message_(message) {}
  const SourceRef& ref() const { return ref_; }
  const std::string& message() const { return message_; }  // without the place

 private:
  SourceRef ref_;
  std::string message_;
};

// A missing, unreadable or corrupt input file (safetensors, golden, data).
class FileError : public UserError {
 public:
  FileError(const std::string& path, const std::string& message)
      : UserError(path + ": " + message) {}
  // The same error, prefixed with the config key that named the file.
  FileError(const SourceRef& named_by, const FileError& e) : UserError(named_by.where() + ": " + e.what()) {}
};

// Runs `f`; a FileError from it names `named_by` (the config file, line and
// key that gave the path) as well as the file.
template <class F>
auto naming_config_key(const SourceRef& named_by, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const FileError& e) {
    throw FileError(named_by, e);
  }
}

// The parallel run does not match its golden file; exit code 1.
class CheckFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Something failed while running (a rank, a collective, I/O); exit code 3.
class RuntimeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Training itself failed (a non-finite loss or gradient under
// train.on_nonfinite: stop): a restart would repeat it; exit code 5.
class Diverged : public RuntimeFailure {
 public:
  Diverged(int64_t step, const std::string& message) : RuntimeFailure(message), step_(step) {}
  int64_t step() const { return step_; }  // the step whose update it stopped before

 private:
  int64_t step_;
};

// The job was asked to stop (SIGTERM or SIGINT) and did so at a step's end,
// after saving a checkpoint when it keeps them; exit code 4.
class Stopped : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request to stop: the first SIGTERM or SIGINT sets it (the step in flight
// finishes on every rank, then the job checkpoints and exits 4); a second ends
// the process at once. install_stop_handlers() arms them in a rank.
void install_stop_handlers();
bool stop_requested();

// Writes out what std::cout, std::cerr and C's streams hold (before a fork,
// whose child would write it again, and before exit_flushed).
void flush_output();

// Ends the process with `code` once its output is flushed, without running
// static destructors: LibTorch's unregister every operator and kernel, about
// a third of a short rank's CPU time, and nothing composer keeps needs them
// (what it writes is closed before its command returns).
[[noreturn]] void exit_flushed(int code);

// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);

// The closest candidate to `word`, or "" when none is close enough.
template <class Range>
std::string nearest(const std::string& word, const Range& candidates) {
  std::string best;
  size_t best_d = word.size() / 3 + 2;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, std::string(c));
    if (d < best_d) {
      best_d = d;
      best = std::string(c);
    }
  }
  return best;
}

}  // namespace composer
