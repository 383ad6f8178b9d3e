// Runs a test body on N ranks, one thread each, with a real Gloo process
// group per mesh slice over a shared in-memory store (c10d::HashStore). The
// collectives are real; only the transport is loopback.
#pragma once
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "models/registry.h"
#include "parallelisms/comm/mesh.h"

namespace composer::testing {

// Rank threads share torch's global generator: seed and draw under this lock.
inline std::mutex& rng_mutex() {
  static std::mutex mu;
  return mu;
}

// A registered model with its default arguments (plus `overrides`), initialised
// from `seed`; safe to call from rank threads.
inline models::ModelPtr seeded_model(const std::string& name, uint64_t seed,
                                     const std::map<std::string, models::ArgValue>& overrides = {}) {
  std::lock_guard<std::mutex> lock(rng_mutex());
  const auto* spec = models::find_model(name);
  models::ModelArgs a;
  for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
  for (const auto& [k, v] : overrides) a.set(k, v);
  torch::manual_seed(seed);
  return spec->build(a);
}

inline void run_ranks(const std::vector<std::string>& names, const std::vector<int64_t>& shape,
                      const std::function<void(parallel::DeviceMesh&)>& body,
                      const std::vector<std::vector<std::string>>& flattened = {}) {
  int world = 1;
  for (auto s : shape) world *= static_cast<int>(s);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        torch::set_num_threads(1);
        parallel::MeshOptions o;
        o.timeout = std::chrono::milliseconds(60000);
        parallel::DeviceMesh mesh(names, shape, r, store, o, flattened);
        body(mesh);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

}  // namespace composer::testing
