#include "parallelisms/expert_parallel.h"

#include <sstream>

#include "models/moe.h"
#include "parallelisms/parallel.h"

namespace composer::parallel {
namespace {

std::vector<models::MoE*> moe_blocks(const std::vector<models::Root>& roots) {
  std::vector<models::MoE*> out;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      if (auto* moe = dynamic_cast<models::MoE*>(m)) out.push_back(moe);
    }
  }
  return out;
}

// The all-to-all dispatch of one block: `rows` sorted by global expert id,
// counts[i] of them for expert i (so grouped by the rank that holds it, in
// rank order), out to their ranks and back.
// `e` experts are held here (n_experts / ep; the registered weights may be
// fully_shard's shards of them).
torch::Tensor dispatch(Group& g, models::GroupedExperts& experts, int64_t e, const torch::Tensor& rows,
                       const std::vector<int64_t>& counts) {
  const int ep = g.size;
  std::vector<int64_t> send(ep, 0);
  for (int r = 0; r < ep; ++r) {
    for (int64_t j = 0; j < e; ++j) send[r] += counts[r * e + j];
  }
  // recv[s * e + j]: the rows rank s sends for this rank's j-th expert. A
  // planning mesh (the dry run) has no peers: it takes uniform routing, where
  // every rank sends what this one sends.
  std::vector<int64_t> recv(ep * e);
  auto got = all_to_all(g, torch::tensor(counts, torch::kLong), std::vector<int64_t>(ep, e),
                        std::vector<int64_t>(ep, e)).contiguous();
  if (g.pg) {
    recv.assign(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + ep * e);
  } else {
    for (int s = 0; s < ep; ++s) {
      for (int64_t j = 0; j < e; ++j) recv[s * e + j] = counts[g.rank * e + j];
    }
  }
  std::vector<int64_t> from(ep, 0), local(e, 0);
  for (int s = 0; s < ep; ++s) {
    for (int64_t j = 0; j < e; ++j) {
      from[s] += recv[s * e + j];
      local[j] += recv[s * e + j];
    }
  }
  auto received = all_to_all_autograd(g, rows, send, from);
  // Received rows are source-major (each source's rows by expert); the
  // experts want expert-major: expert j's rows from rank 0, then rank 1, ...
  std::vector<int64_t> start(ep * e), order;
  order.reserve(static_cast<size_t>(received.size(0)));
  int64_t at = 0;
  for (int s = 0; s < ep; ++s) {
    for (int64_t j = 0; j < e; ++j) {
      start[s * e + j] = at;
      at += recv[s * e + j];
    }
  }
  for (int64_t j = 0; j < e; ++j) {
    for (int s = 0; s < ep; ++s) {
      for (int64_t t = 0; t < recv[s * e + j]; ++t) order.push_back(start[s * e + j] + t);
    }
  }
  auto perm = torch::tensor(order, torch::kLong).to(rows.device());
  auto out = experts.run(received.index_select(0, perm), local);
  auto back = torch::zeros_like(out).index_copy(0, perm, out);
  return all_to_all_autograd(g, back, from, send);
}

}  // namespace

bool apply(Applying& a, const ExpertParallelConfig& config) {
  Parallel& par = a.par;
  Group& group = a.group(config.mesh_dim);
  torch::NoGradGuard no_grad;
  // A pipeline rank may hold no block (only the embeddings, say): its
  // parameters are still replicated over ep.
  const auto blocks = moe_blocks(par.roots);
  const int ep = group.size;
  ParamSet experts;
  for (models::MoE* moe : blocks) {
    const int64_t n = moe->args().experts;
    TORCH_CHECK(n % ep == 0, "expert_parallel: ", n, " experts do not split over ", ep, " ranks");
    const int64_t e = n / ep;
    for (torch::Tensor* w : {&moe->experts->w1, &moe->experts->w2, &moe->experts->w3}) {
      // Recorded first, while the tensor has its global shape; then this rank's
      // block of experts (a model still on meta gets its values later).
      par.placements->add(*w, {group.name, &group, ep, group.rank, Placement::shard(0),
                               Placement::partial(Reduce::kAvg)});
      w->set_data(w->detach().narrow(0, group.rank * e, e).clone());
      if (ep > 1) par.grad_factors.emplace_back(*w, 1.0 / ep);
      experts.insert(w->unsafeGetTensorImpl());
    }
    Group* g = &group;
    models::GroupedExperts* held = moe->experts.get();
    moe->dispatch = [g, held, e](const torch::Tensor& rows, const std::vector<int64_t>& counts) {
      return dispatch(*g, *held, e, rows, counts);
    };
  }
  for (auto& [name, p] : models::root_parameters(par.roots)) {
    if (experts.count(p.unsafeGetTensorImpl())) continue;
    if (group.pg && !p.is_meta()) broadcast(group, p, 0);
    par.placements->add(p, {group.name, &group, ep, group.rank, Placement::replicate(),
                            Placement::partial(Reduce::kAvg)});
  }
  std::ostringstream line;
  const int64_t n = blocks.empty() ? 0 : blocks.front()->args().experts;
  line << "applied expert_parallel " << over(&group) << ": " << n / ep << " of " << n << " experts per rank in "
       << blocks.size() << " mixture-of-experts block" << (blocks.size() == 1 ? "" : "s")
       << (blocks.empty() ? " (this rank's pipeline stages have none)" : ", tokens dispatched by all-to-all");
  a.log(line.str());
  return true;
}

void trace(Tracing&, const ExpertParallelConfig&) {}

}  // namespace composer::parallel
