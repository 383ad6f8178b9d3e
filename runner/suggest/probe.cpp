#include "runner/suggest/probe.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "parallelisms/comm/collectives.h"
#include "runner/base/errors.h"

namespace composer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// LibTorch's intra-op threads set to a rank's while a probe measures, and set back after.
class RankThreads {
 public:
  explicit RankThreads(int threads) : outer_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~RankThreads() { at::set_num_threads(outer_); }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

 private:
  int outer_;
};

// Runs fn(i) on `n` threads at once and returns each one's result: the node's ranks sharing the cores.
std::vector<double> at_once(int64_t n, const std::function<double(int)>& fn) {
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { out[static_cast<size_t>(i)] = fn(i); });
  for (auto& t : threads) t.join();
  return out;
}

// The threads' rates summed and shared out: what the cores give each rank, whatever the scheduler's
// order (one thread's own rate swings with it).
double shared_rate(const std::vector<double>& per_thread) {
  double sum = 0;
  for (double x : per_thread) sum += x;
  return per_thread.empty() ? 0.0 : sum / static_cast<double>(per_thread.size());
}

// Repeats `op` for about `seconds` and returns the repetitions per second.
double per_second(const std::function<void()>& op, double seconds) {
  op();  // warm-up
  const auto t0 = Clock::now();
  int64_t reps = 0;
  double elapsed = 0;
  while (elapsed < seconds) {
    op();
    ++reps;
    elapsed = seconds_since(t0);
  }
  return static_cast<double>(reps) / elapsed;
}

// The median of three trials of `rate` (each the node's threads at once): one trial swings by 15% here.
double steady(const std::function<double()>& rate) {
  std::vector<double> trials{rate(), rate(), rate()};
  std::sort(trials.begin(), trials.end());
  return trials[1];
}

double matmul_at(int64_t ranks, int64_t rows, int64_t k, int64_t n) {
  torch::NoGradGuard no_grad;
  auto a = torch::randn({rows, k}), b = torch::randn({k, n});
  return steady([&] {
    return shared_rate(at_once(ranks, [&](int) {
      auto x = a.clone(), y = b.clone();
      return 2.0 * static_cast<double>(rows * k * n) * per_second([&] { x.mm(y); }, 0.07);
    }));
  });
}

// A memory-bound product of two 8 MiB tensors into a third: bytes read and written per second.
double elementwise_rate(int64_t ranks) {
  return steady([&] {
    return shared_rate(at_once(ranks, [&](int) {
      torch::NoGradGuard no_grad;
      const int64_t numel = int64_t{1} << 21;
      auto a = torch::randn({numel}), b = torch::randn({numel}), c = torch::empty({numel});
      return 3.0 * 4 * static_cast<double>(numel) * per_second([&] { torch::mul_out(c, a, b); }, 0.07);
    }));
  });
}

// One op's fixed cost: a tiny forward of three ops and its backward (four more), per op.
double kernel_cost(int64_t ranks) {
  return 1.0 / steady([&] {
    return shared_rate(at_once(ranks, [&](int) {
      auto x = torch::ones({8}, torch::requires_grad());
      return 7.0 * per_second([&] { ((x * 2 + 1).sum()).backward(); }, 0.07);  // ops per second
    }));
  });
}

// The collectives a probe times once per repetition (returning how many it ran), over tensors readied for
// them outside the timing.
using TimedCollectives = std::function<int()>;

// A collective's cost on groups of `g` ranks, all the node's groups at once, each rank computing for a few
// milliseconds between collectives as in a step: the time a rank waits in the collectives `make(group,
// floats)` readies (its peers' lateness included, as a run's comm_wait_ms counts it), each sending `sends`
// x (g - 1) / g of `floats` float32s from each rank (1 for a ring's all-gather or reduce-scatter and an
// all-to-all, 2 for an all-reduce), averaged over ranks and repetitions at three sizes, fitted as latency +
// bytes sent / bandwidth by least squares.
LinkCost fitted_cost(int64_t ranks, int64_t g, double sends,
                     const std::function<TimedCollectives(parallel::Group&, int64_t)>& make) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<int64_t> sizes{int64_t{1} << 12, int64_t{1} << 18, int64_t{1} << 21};  // floats: 16 KiB to 8 MiB
  const int reps = 24;

  std::vector<double> waited(sizes.size(), 0.0);
  std::mutex m;
  at_once(ranks, [&](int r) {
    parallel::MeshOptions o;
    parallel::DeviceMesh mesh({"o", "g"}, {ranks / g, g}, r, store, o);
    parallel::Group& group = mesh.group("g");
    torch::NoGradGuard no_grad;
    auto a = torch::randn({160, 160}), b = torch::randn({160, 160});
    for (size_t s = 0; s < sizes.size(); ++s) {
      const TimedCollectives run = make(group, sizes[s]);
      run();  // connect and align the group
      double total = 0;
      int collectives = 0;
      for (int i = 0; i < reps; ++i) {
        for (int k = 0; k < 40; ++k) a.mm(b);  // about 10 ms a rank on shared cores: longer lets ranks drift as in a step
        const auto t0 = Clock::now();
        collectives += run();
        total += seconds_since(t0);
      }
      std::lock_guard<std::mutex> lock(m);
      waited[s] += total / (static_cast<double>(collectives) * static_cast<double>(ranks));
    }
    return 0.0;
  });
  const double share = sends * static_cast<double>(g - 1) / static_cast<double>(g);
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double k = static_cast<double>(sizes.size());
  for (size_t s = 0; s < sizes.size(); ++s) {
    const double x = 4.0 * static_cast<double>(sizes[s]) * share, y = waited[s];
    sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double slope = (k * sxy - sx * sy) / (k * sxx - sx * sx);
  LinkCost c;
  c.bytes_per_s = slope > 0 ? 1.0 / slope : 1e12;
  c.latency_s = std::max(0.0, (sy - (slope > 0 ? slope : 0.0) * sx) / k);
  return c;
}

// An all-gather and a reduce-scatter, as fully_shard, replicate's rings and tensor and context parallelism
// run them (each a ring of g - 1 hops over Gloo).
LinkCost collective_cost(int64_t ranks, int64_t g) {
  return fitted_cost(ranks, g, 1, [g](parallel::Group& group, int64_t floats) -> TimedCollectives {
    auto full = torch::randn({floats});
    auto piece = torch::randn({floats / g});
    return [&group, full, piece, g]() mutable {
      parallel::all_gather_into(group, piece, full.view({g, -1})).wait();
      piece = parallel::reduce_scatter_flat(group, full.clone());
      return 2;
    };
  });
}

// One of the collectives composer runs natively over Gloo (not as its own rings): an all-to-all of equal
// pieces, as expert_parallel's dispatch and combine and the alltoall context parallelism run it (every pair
// at once: one hop), or an all-reduce, as replicate's buckets, tensor parallelism without sequence
// parallelism and the step's statistics run it.
LinkCost native_cost(MachineRates::Collective kind, int64_t ranks, int64_t g) {
  if (kind == MachineRates::Collective::kAllReduce) {
    return fitted_cost(ranks, g, 2, [](parallel::Group& group, int64_t floats) -> TimedCollectives {
      auto t = torch::randn({floats});
      return [&group, t]() mutable {
        parallel::all_reduce(group, t, parallel::Reduce::kSum, false);
        return 1;
      };
    });
  }
  return fitted_cost(ranks, g, 1, [g](parallel::Group& group, int64_t floats) -> TimedCollectives {
    const int64_t rows = floats / 64;
    auto input = torch::randn({rows, 64});
    const std::vector<int64_t> counts(static_cast<size_t>(g), rows / g);
    return [&group, input, counts]() {
      parallel::all_to_all(group, input, counts, counts);
      return 1;
    };
  });
}

// The core time a collective's bytes take from ranks computing beside it: the node's first half of ranks
// all-gather and reduce-scatter 8 MiB over their group, a fixed number of times, while the second half
// multiply; the matmuls' rate against the same half multiplying beside idle ranks gives the core-seconds
// the collectives took from them, over the bytes the first half sent (timed from when the group has
// connected). Where the cores are not shared
// (fewer ranks than cores are computing at once) nothing is taken: 0.
double comm_core_cost(int64_t ranks, int64_t cores) {
  const int64_t g = ranks / 2;
  if (g < 2 || ranks <= cores) return 0.0;
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int64_t numel = int64_t{1} << 21;
  const int reps = 16;
  std::atomic<int> ready{0}, done{0};
  auto multiply_while = [&](const std::function<bool()>& more) {
    torch::NoGradGuard no_grad;
    auto a = torch::randn({256, 256}), b = torch::randn({256, 256});
    a.mm(b);
    int64_t n = 0;
    const auto t0 = Clock::now();
    while (more()) a.mm(b), ++n;
    return 2.0 * 256 * 256 * 256 * static_cast<double>(n) / seconds_since(t0);
  };
  // beside idle ranks
  const auto alone = at_once(ranks - g, [&](int) {
    const auto t0 = Clock::now();
    return multiply_while([&] { return seconds_since(t0) < 0.3; });
  });
  double elapsed = 0;
  std::mutex m;
  const auto beside = at_once(ranks, [&](int r) {
    parallel::MeshOptions o;
    parallel::DeviceMesh mesh({"o", "g"}, {2, g}, r, store, o);
    if (r >= g) {
      while (ready.load() < g) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the group connected
      const auto t0 = Clock::now();
      const double rate = multiply_while([&] { return done.load() < g; });
      std::lock_guard<std::mutex> lock(m);
      elapsed = std::max(elapsed, seconds_since(t0));
      return rate;
    }
    parallel::Group& group = mesh.group("g");
    torch::NoGradGuard no_grad;
    auto full = torch::randn({numel});
    auto piece = torch::randn({numel / g});
    parallel::all_gather_into(group, piece, full.view({g, -1})).wait();  // connect the group, uncounted
    ++ready;
    for (int i = 0; i < reps; ++i) {
      parallel::all_gather_into(group, piece, full.view({g, -1})).wait();
      piece = parallel::reduce_scatter_flat(group, full.clone());
    }
    ++done;
    return 0.0;
  });
  // each gathering rank sends (g - 1) / g of 8 MiB twice a repetition
  const double sent = static_cast<double>(g) * 2.0 * reps * 4.0 * static_cast<double>(numel) *
                      static_cast<double>(g - 1) / static_cast<double>(g);
  double before = 0, after = 0;
  for (double x : alone) before += x;
  for (int64_t r = g; r < ranks; ++r) after += beside[static_cast<size_t>(r)];
  if (before <= 0) return 0.0;
  // core-seconds lost by the multiplying ranks together, over the bytes sent
  const double lost = std::max(0.0, 1.0 - after / before) * elapsed * static_cast<double>(ranks - g);
  return lost / sent;
}

nlohmann::json link_json(const LinkCost& c) { return {{"latency_s", c.latency_s}, {"bytes_per_s", c.bytes_per_s}}; }

LinkCost link_of(const nlohmann::json& j) { return {j.at("latency_s").get<double>(), j.at("bytes_per_s").get<double>()}; }

std::string shape_key(const std::tuple<int64_t, int64_t, int64_t>& s) {
  return std::to_string(std::get<0>(s)) + "x" + std::to_string(std::get<1>(s)) + "x" + std::to_string(std::get<2>(s));
}

nlohmann::json read_cache() {
  std::ifstream f(machine_cache_path());
  if (!f) return nlohmann::json::object();
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json::object();  // a damaged cache is measured again
  }
}

}  // namespace

double MachineRates::matmul_rate(int64_t rows, int64_t k, int64_t n) {
  const auto key = std::make_tuple(rows, k, n);
  auto it = shapes.find(key);
  if (it != shapes.end()) return it->second;
  if (!measure) return matmul_flops;
  const RankThreads at_rank(threads);
  const double rate = matmul_at(concurrent ? ranks : 1, std::min<int64_t>(rows, 8192), k, n);
  shapes[key] = rate;
  dirty = true;
  return rate;
}

double MachineRates::per_element_s(const std::string& what,
                                   const std::function<std::function<void()>(int64_t)>& make) {
  auto it = per_element.find(what);
  if (it != per_element.end()) return it->second;
  if (!measure) return 0.0;
  const int64_t elements = int64_t{1} << 22;  // 16 MiB a float32 tensor: past the caches, as a model's are
  const RankThreads at_rank(threads);
  const double passes = steady([&] {
    return shared_rate(at_once(concurrent ? ranks : 1, [&](int) {
      const std::function<void()> pass = make(elements);
      return per_second(pass, 0.15);
    }));
  });
  const double s = passes > 0 ? 1.0 / (passes * static_cast<double>(elements)) : 0.0;
  per_element[what] = s;
  dirty = true;
  return s;
}

LinkCost MachineRates::native(Collective kind, int64_t group_size, bool within_node) {
  auto& by_size = kind == Collective::kAllToAll ? exchange_by_size : reduce_by_size;
  auto it = by_size.find(group_size);
  if (within_node && it != by_size.end()) return it->second;
  if (!within_node || !measure || !concurrent || group_size < 2 || ranks % group_size != 0) {
    return link(group_size, within_node);
  }
  const RankThreads at_rank(threads);
  const LinkCost c = native_cost(kind, ranks, group_size);
  by_size[group_size] = c;
  dirty = true;
  return c;
}

double MachineRates::comm_core_s() {
  if (comm_core_s_per_byte >= 0) return comm_core_s_per_byte;
  if (!measure) return 0.0;
  const RankThreads at_rank(threads);
  comm_core_s_per_byte = steady([&] { return comm_core_cost(concurrent ? ranks : 1, cores); });
  dirty = true;
  return comm_core_s_per_byte;
}

void MachineRates::refit() {
  runs_fitted = static_cast<int64_t>(runs.size());
  compute_fit = latency_fit = bandwidth_fit = 1;
  // Each run's step, measured against a x its predicted compute + b x its predicted communication, by least
  // squares on the relative error: what a run measures as waiting (a peer still computing, a pipeline's
  // other stage, uneven routing) is not what the model calls communication, so the steps are fitted, not
  // each part apart. One factor for both where one run is all there is, or the two fitted would not both
  // be above 0 (runs of one mix).
  double cc = 0, cm = 0, mm = 0, c1 = 0, m1 = 0, predicted = 0, measured = 0;
  for (const auto& f : runs) {
    const double step = f.measured_compute + f.measured_comm;
    if (!(step > 0)) continue;
    const double c = f.compute / step, m = (f.latency + f.bytes) / step;
    cc += c * c, cm += c * m, mm += m * m, c1 += c, m1 += m;
    predicted += f.compute + f.latency + f.bytes, measured += step;
  }
  if (!(predicted > 0)) return;
  auto clamp = [](double x) { return std::min(10.0, std::max(0.1, x)); };
  const double det = cc * mm - cm * cm;
  if (runs.size() >= 2 && det > 1e-6 * cc * mm) {
    const double a = (c1 * mm - m1 * cm) / det, b = (m1 * cc - c1 * cm) / det;
    if (a > 0 && b > 0) {
      compute_fit = clamp(a), latency_fit = bandwidth_fit = clamp(b);
      return;
    }
  }
  compute_fit = latency_fit = bandwidth_fit = clamp(measured / predicted);
}

std::string MachineRates::describe() const {
  std::ostringstream o;
  o.precision(4);
  o << "rates (" << source << "): matmul " << matmul_flops / 1e9 << " GFLOP/s per rank at 1024^3"
    << (shapes.empty() ? "" : " (and at each plan's shapes)") << ", elementwise " << elementwise_bytes_per_s / 1e9
    << " GB/s, " << kernel_s * 1e6 << " us per op";
  for (const auto& [what, sec] : per_element) o << ", " << what << " " << sec * 1e9 << " ns per parameter element";
  if (comm_core_s_per_byte > 0) o << ", collectives take " << comm_core_s_per_byte * 1e9 << " ns of core per byte";
  for (const auto& [g, c] : intra_by_size) {
    o << ", " << g << " ranks " << c.latency_s * 1e6 << " us + " << c.bytes_per_s / 1e9 << " GB/s";
  }
  for (const auto& [g, c] : exchange_by_size) {
    o << ", all-to-all of " << g << " ranks " << c.latency_s * 1e6 << " us + " << c.bytes_per_s / 1e9 << " GB/s";
  }
  for (const auto& [g, c] : reduce_by_size) {
    o << ", all-reduce of " << g << " ranks " << c.latency_s * 1e6 << " us + " << c.bytes_per_s / 1e9 << " GB/s";
  }
  if (intra_by_size.empty()) o << ", within a node " << intra.latency_s * 1e6 << " us + " << intra.bytes_per_s / 1e9 << " GB/s";
  o << ", across nodes " << inter.latency_s * 1e6 << " us + " << inter.bytes_per_s / 1e9 << " GB/s";
  if (runs_fitted) {
    o << "; refit from " << runs_fitted << " run(s): compute x" << compute_fit << ", communication latency x"
      << latency_fit << ", bytes x" << bandwidth_fit;
  }
  return o.str();
}

double MachineRates::core_share() const {
  const double threads_at_once = static_cast<double>(std::max<int64_t>(1, ranks) * std::max(1, threads));
  return concurrent && cores > 0 ? std::min(1.0, static_cast<double>(cores) / threads_at_once) : 1.0;
}

LinkCost MachineRates::link(int64_t group_size, bool within_node) const {
  if (!within_node) return inter;
  auto it = intra_by_size.lower_bound(group_size);
  if (it != intra_by_size.end()) return it->second;
  return intra_by_size.empty() ? intra : intra_by_size.rbegin()->second;
}

nlohmann::json to_json(const MachineRates& r) {
  nlohmann::json j = {{"source", r.origin.empty() ? r.source : r.origin},
                      {"matmul_flops", r.matmul_flops},
                      {"elementwise_bytes_per_s", r.elementwise_bytes_per_s},
                      {"kernel_s", r.kernel_s},
                      {"intra", link_json(r.intra)},
                      {"inter", link_json(r.inter)},
                      {"compute_fit", r.compute_fit},
                      {"latency_fit", r.latency_fit},
                      {"bandwidth_fit", r.bandwidth_fit},
                      {"runs_fitted", r.runs_fitted}};
  j["runs"] = nlohmann::json::array();
  for (const auto& f : r.runs) {
    j["runs"].push_back({{"plan", f.plan}, {"compute_s", f.compute}, {"latency_s", f.latency}, {"bytes_s", f.bytes},
                         {"measured_compute_s", f.measured_compute}, {"measured_comm_s", f.measured_comm}});
  }
  for (const auto& [g, c] : r.intra_by_size) j["intra_by_size"][std::to_string(g)] = link_json(c);
  for (const auto& [g, c] : r.exchange_by_size) j["exchange_by_size"][std::to_string(g)] = link_json(c);
  for (const auto& [g, c] : r.reduce_by_size) j["reduce_by_size"][std::to_string(g)] = link_json(c);
  for (const auto& [s, rate] : r.shapes) j["matmul_by_shape"][shape_key(s)] = rate;
  for (const auto& [what, s] : r.per_element) j["per_element_s"][what] = s;
  if (r.comm_core_s_per_byte >= 0) j["comm_core_s_per_byte"] = r.comm_core_s_per_byte;
  return j;
}

MachineRates rates_from_json(const nlohmann::json& j, const std::string& where) {
  MachineRates r;
  try {
    r.source = j.value("source", where);
    r.origin = r.source;
    r.matmul_flops = j.at("matmul_flops").get<double>();
    r.elementwise_bytes_per_s = j.at("elementwise_bytes_per_s").get<double>();
    r.kernel_s = j.value("kernel_s", 0.0);
    r.comm_core_s_per_byte = j.value("comm_core_s_per_byte", -1.0);
    r.intra = link_of(j.at("intra"));
    r.inter = j.contains("inter") ? link_of(j.at("inter")) : r.intra;
    for (const auto& f : j.value("runs", nlohmann::json::array())) {
      r.runs.push_back({f.value("plan", ""), f.at("compute_s").get<double>(), f.at("latency_s").get<double>(),
                        f.at("bytes_s").get<double>(), f.at("measured_compute_s").get<double>(),
                        f.at("measured_comm_s").get<double>()});
    }
    r.refit();
    const nlohmann::json by_size = j.value("intra_by_size", nlohmann::json::object());
    const nlohmann::json by_shape = j.value("matmul_by_shape", nlohmann::json::object());
    const nlohmann::json per_element = j.value("per_element_s", nlohmann::json::object());
    for (const auto& [what, s] : per_element.items()) r.per_element[what] = s.get<double>();
    for (const auto& [g, c] : by_size.items()) {
      r.intra_by_size[std::stoll(g)] = link_of(c);
    }
    const nlohmann::json exchanges = j.value("exchange_by_size", nlohmann::json::object());
    for (const auto& [g, c] : exchanges.items()) r.exchange_by_size[std::stoll(g)] = link_of(c);
    const nlohmann::json reduces = j.value("reduce_by_size", nlohmann::json::object());
    for (const auto& [g, c] : reduces.items()) r.reduce_by_size[std::stoll(g)] = link_of(c);
    for (const auto& [s, rate] : by_shape.items()) {
      int64_t a = 0, b = 0, c = 0;
      char x1 = 0, x2 = 0;
      std::istringstream in(s);
      in >> a >> x1 >> b >> x2 >> c;
      if (in && x1 == 'x' && x2 == 'x') r.shapes[{a, b, c}] = rate.get<double>();
    }
  } catch (const std::exception& e) {
    throw UserError(where + ": not a rates file (" + e.what() +
                    "); it needs matmul_flops, elementwise_bytes_per_s and intra {latency_s, bytes_per_s}, as "
                    "composer suggest writes into " + machine_cache_path());
  }
  if (r.matmul_flops <= 0 || r.elementwise_bytes_per_s <= 0 || r.intra.bytes_per_s <= 0) {
    throw UserError(where + ": matmul_flops, elementwise_bytes_per_s and intra.bytes_per_s must be above 0");
  }
  return r;
}

std::string machine_cache_path() {
  if (const char* d = std::getenv("COMPOSER_CACHE_DIR"); d && *d) return std::string(d) + "/machine.json";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/composer/machine.json";
}

std::string machine_key(int64_t ranks, int threads) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + " cpu cores" + std::to_string(std::max<unsigned>(1, std::thread::hardware_concurrency())) +
         " ranks" + std::to_string(ranks) + " threads" + std::to_string(threads);
}

void save_rates(const MachineRates& r) {
  nlohmann::json cache = read_cache();
  cache["entries"][r.key] = to_json(r);
  const std::filesystem::path path = machine_cache_path();
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  const std::string tmp = path.string() + ".tmp" + std::to_string(getpid());
  std::ofstream(tmp) << cache.dump(1) << "\n";
  std::filesystem::rename(tmp, path, ec);
}

MachineRates probe_machine(int64_t ranks, int threads, bool again) {
  const std::string key = machine_key(ranks, threads);
  const nlohmann::json cache = read_cache();
  const bool concurrent = threads == 1;  // ranks of one thread share the cores; more threads: one rank measured
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  if (!again && cache.contains("entries") && cache["entries"].contains(key)) {
    MachineRates r = rates_from_json(cache["entries"][key], machine_cache_path());
    r.key = key, r.measure = true, r.threads = threads, r.ranks = ranks, r.concurrent = concurrent, r.cores = cores;
    r.source = "cached in " + machine_cache_path() + " (" + r.source + ")";
    return r;
  }
  const auto t0 = Clock::now();
  const RankThreads at_rank(threads);
  MachineRates r;
  r.key = key, r.measure = true, r.threads = threads, r.ranks = ranks, r.concurrent = concurrent, r.cores = cores;
  const int64_t at = concurrent ? ranks : 1;
  r.matmul_flops = matmul_at(at, 1024, 1024, 1024);
  r.elementwise_bytes_per_s = elementwise_rate(at);
  r.kernel_s = kernel_cost(at);
  for (int64_t g = 2; g <= ranks; ++g) {
    if (ranks % g == 0) r.intra_by_size[g] = collective_cost(ranks, g);
  }
  r.intra = r.intra_by_size.empty() ? LinkCost{20e-6, 2e9} : r.intra_by_size.rbegin()->second;
  r.inter = {r.intra.latency_s * 2, r.intra.bytes_per_s / 2};  // not measurable from one node: half the node's
  r.comm_core_s();
  std::ostringstream s;
  s.precision(3);
  s << "probed here in " << seconds_since(t0) << " s";
  r.source = s.str();
  r.dirty = true;
  return r;
}

MachineRates gpu_default_rates() {
  MachineRates r;
  r.source = "defaults for an H100-class GPU; give the cluster's with --rates FILE";
  r.matmul_flops = 400e12;
  r.elementwise_bytes_per_s = 2.5e12;
  r.kernel_s = 5e-6;
  r.intra = {20e-6, 200e9};
  r.inter = {40e-6, 25e9};
  return r;
}

namespace {

// tools/gpu-bench's summary.json: the rate composer's training step reached on the card, as the
// matmul rate. It folds the step's other work (norms, the optimizer, kernel launches) into that
// rate, which the cost model prices again on its own, so the steps priced from it come out long
// by that share; the ranking of plans on that card is what it is for.
MachineRates rates_from_gpu_bench(const nlohmann::json& j, const std::string& path, bool cuda) {
  const std::string where = "--rates " + path;
  if (!cuda) {
    throw UserError(where + ": a tools/gpu-bench summary prices GPUs; the config's mesh.device is cpu (set it to "
                            "cuda, or give the probe's rates)");
  }
  double flops = 0, step_ms = 0;
  std::string card;
  try {
    flops = j.at("model_flops_per_step").get<double>();
    step_ms = j.at("rows").at("composer").at("step_ms").get<double>();
    card = j.value("card", std::string("a GPU"));
  } catch (const std::exception& e) {
    throw UserError(where + ": a tools/gpu-bench summary without model_flops_per_step or rows.composer.step_ms (" +
                    e.what() + "); give the summary.json that tools/gpu-bench wrote");
  }
  if (!(flops > 0) || !(step_ms > 0)) {
    throw UserError(where + ": model_flops_per_step and rows.composer.step_ms must be above 0");
  }
  MachineRates r = gpu_default_rates();
  r.matmul_flops = flops / (step_ms / 1e3);
  std::ostringstream s;
  s.precision(4);
  s << "tools/gpu-bench on " << card << " (" << path << "): composer's step at " << r.matmul_flops / 1e12
    << " TFLOP/s as the matmul rate; the rest an H100-class GPU's defaults";
  r.source = r.origin = s.str();
  return r;
}

}  // namespace

MachineRates rates_from_file(const std::string& path, bool cuda) {
  std::ifstream f(path);
  if (!f) throw UserError("--rates " + path + ": cannot read the file");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw UserError("--rates " + path + ": not JSON (" + e.what() + ")");
  }
  if (j.is_object() && j.contains("rows") && j.contains("model_flops_per_step")) {
    return rates_from_gpu_bench(j, path, cuda);
  }
  MachineRates r = rates_from_json(j, "--rates " + path);
  r.source = "given in " + path;
  return r;
}

}  // namespace composer
