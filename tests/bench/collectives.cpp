// Measures composer's ring reduce-scatter and all-gather (send/recv over a
// Gloo group) against Gloo's own (_reduce_scatter_base, _allgather_base), and
// checks Gloo's reduce-scatter against closed forms for sum, avg and max.
// Ranks are processes-in-threads over loopback TCP, as in the dist tests.
//   build/tests/composer_bench_collectives [ranks] [MiB...]
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <iostream>
#include <thread>

#include "parallelisms/comm/collectives.h"

using namespace composer::parallel;

namespace {

double median_ms(int reps, const std::function<void()>& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto s = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Rank r holds r + 1 + i/numel at element i: the sum over n ranks of element
// i is n(n+1)/2 + n i/numel, the max is n + i/numel.
torch::Tensor rank_data(int r, int64_t numel) {
  return torch::arange(numel, torch::kFloat) / static_cast<double>(numel) + (r + 1);
}

std::string check_native_reduce_scatter(Group& g, int64_t numel) {
  std::string out;
  const int n = g.size;
  const int64_t chunk = numel / n;
  auto idx = torch::arange(g.rank * chunk, (g.rank + 1) * chunk, torch::kFloat) / static_cast<double>(numel);
  const std::pair<c10d::ReduceOp::RedOpType, torch::Tensor> cases[] = {
      {c10d::ReduceOp::SUM, idx * n + n * (n + 1) / 2.0},
      {c10d::ReduceOp::AVG, idx + (n + 1) / 2.0},
      {c10d::ReduceOp::MAX, idx + n}};
  const char* names[] = {"sum", "avg", "max"};
  for (int k = 0; k < 3; ++k) {
    auto in = rank_data(g.rank, numel);
    auto mine = torch::empty({chunk});
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp(cases[k].first);
    std::string verdict;
    try {
      g.pg->_reduce_scatter_base(mine, in, o)->wait();
      const double err = (mine - cases[k].second).abs().max().item<double>();
      verdict = err < 1e-4 ? "correct" : "WRONG (max error " + std::to_string(err) + ")";
    } catch (const std::exception& e) {
      verdict = std::string("unsupported (") + std::string(e.what()).substr(0, 60) + ")";
    }
    out += std::string(out.empty() ? "" : ", ") + names[k] + " " + verdict;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  std::vector<double> mibs;
  for (int i = 2; i < argc; ++i) mibs.push_back(std::atof(argv[i]));
  if (mibs.empty()) mibs = {0.25, 4, 32};
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      torch::set_num_threads(1);
      MeshOptions o;
      DeviceMesh mesh({"dp"}, {world}, r, store, o);
      Group& g = mesh.group("dp");
      const std::string verdict = check_native_reduce_scatter(g, 1 << 12);
      if (r == 0) std::cout << world << " ranks; Gloo's reduce-scatter: " << verdict << "\n";
      for (double mib : mibs) {
        const int64_t numel = static_cast<int64_t>(mib * (1 << 20) / 4) / world * world;
        auto full = rank_data(r, numel);
        auto mine = torch::empty({numel / world});
        auto gathered = torch::empty({world, numel / world});
        const int reps = 9;
        const double ring_rs = median_ms(reps, [&] { reduce_scatter_flat(g, full.clone(), Reduce::kSum); });
        const double gloo_rs = median_ms(reps, [&] {
          auto in = full.clone();
          g.pg->_reduce_scatter_base(mine, in)->wait();
        });
        const double ring_ag = median_ms(reps, [&] { all_gather_into(g, mine, gathered); });
        const double gloo_ag = median_ms(reps, [&] {
          auto out = gathered.view({-1});
          g.pg->_allgather_base(out, mine)->wait();
        });
        if (r == 0) {
          std::printf("%7.2f MiB  reduce-scatter ring %8.2f ms  gloo %8.2f ms (gloo/ring %.2f)   "
                      "all-gather ring %8.2f ms  gloo %8.2f ms (gloo/ring %.2f)\n",
                      mib, ring_rs, gloo_rs, gloo_rs / ring_rs, ring_ag, gloo_ag, gloo_ag / ring_ag);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
}
