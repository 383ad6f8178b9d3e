// composer score: the log-probability a model gives each sequence of a token
// file, forward only under the config's plan. Every rank reads the file; each
// global batch holds train.global_batch sequences, one per row, padded to
// data.seq_len; the ranks run their part as evaluation runs it (their
// data-parallel rows, microbatches, sequence slice, pipeline stage) and send
// each target's -log p to rank 0, which writes one JSON line per sequence.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "parallelisms/comm/collectives.h"
#include "parallelisms/fully_shard.h"
#include "runner/base/errors.h"
#include "runner/checkpoint/weight_source.h"
#include "runner/cli/cli.h"
#include "runner/train/build.h"
#include "runner/train/datasets.h"
#include "runner/train/step.h"

namespace composer {
namespace {

namespace fs = std::filesystem;

int64_t doc_begin(const Documents& d, size_t q) { return q ? d.ends[q - 1] : 0; }

// --data's documents, each one window (at most seq_len + 1 tokens) of ids the model's vocabulary holds.
Documents score_documents(const std::string& path, const ExperimentConfig& c, const DataPlan& data) {
  Documents d = read_documents(path, c.data.token_dtype.value_or(TokenDType::kUint16));
  for (size_t q = 0; q < d.ends.size(); ++q) {
    const int64_t len = d.ends[q] - doc_begin(d, q);
    if (len > data.seq_len + 1) {
      throw UserError("--data " + path + ": sequence " + std::to_string(q) + " holds " + std::to_string(len) +
                      " tokens, more than data.seq_len + 1 = " + std::to_string(data.seq_len + 1) +
                      "; composer score scores each document whole in one row: set data.seq_len to at least " +
                      std::to_string(len - 1) + " (--set data.seq_len=" + std::to_string(len - 1) +
                      "), or split the document");
    }
  }
  const auto high = std::max_element(d.tokens.begin(), d.tokens.end());
  if (high != d.tokens.end() && *high >= data.input.vocab_size) {
    throw UserError("--data " + path + ": token " + std::to_string(high - d.tokens.begin()) + " is id " +
                    std::to_string(*high) + ", outside model " + c.model.name + "'s vocabulary of " +
                    std::to_string(data.input.vocab_size) + "; tokenise the data with the model's tokenizer (and "
                    "check data.token_dtype)");
  }
  return d;
}

// Rows [first, first + n) of a score batch: row r holds sequence first + r
// (none past the last), its ids as inputs and the next ids as targets, -100
// past its end; `positions` each token's index in its row.
struct ScoreBatch {
  Batch batch;
  torch::Tensor positions;
};

ScoreBatch score_batch(const Documents& d, int64_t first, int64_t n, int64_t seq_len, c10::Device device) {
  torch::Tensor inputs = torch::zeros({n, seq_len}, torch::kLong), targets = torch::full({n, seq_len}, -100, torch::kLong);
  auto in = inputs.accessor<int64_t, 2>();
  auto out = targets.accessor<int64_t, 2>();
  for (int64_t r = 0; r < n && first + r < static_cast<int64_t>(d.ends.size()); ++r) {
    const auto q = static_cast<size_t>(first + r);
    const int64_t begin = doc_begin(d, q), len = d.ends[q] - begin;
    for (int64_t j = 0; j + 1 < len; ++j) {
      in[r][j] = d.tokens[static_cast<size_t>(begin + j)];
      out[r][j] = d.tokens[static_cast<size_t>(begin + j + 1)];
    }
  }
  ScoreBatch b;
  b.batch.inputs = inputs.to(device);
  b.batch.targets = targets.to(device);
  b.positions = torch::arange(seq_len, torch::dtype(torch::kLong)).expand({n, seq_len}).contiguous().to(device);
  return b;
}

// Rank 0: every rank's rows (its own `mine`, the others' received in rank order); the others send theirs.
torch::Tensor gather_rows(parallel::Group* world, int rank, const torch::Tensor& mine) {
  if (!world || world->size == 1) return mine;
  if (rank != 0) {
    parallel::send(*world, torch::tensor({mine.size(0)}, torch::kLong), 0);
    if (mine.size(0)) parallel::send(*world, mine.contiguous(), 0);
    return {};
  }
  std::vector<torch::Tensor> all{mine};
  for (int r = 1; r < world->size; ++r) {
    torch::Tensor n = torch::zeros({1}, torch::kLong);
    parallel::recv(*world, n, r);
    torch::Tensor rows = torch::empty({n.item<int64_t>(), 3}, torch::kDouble);
    if (rows.size(0)) parallel::recv(*world, rows, r);
    all.push_back(rows);
  }
  return torch::cat(all);
}

// Each sequence's log-probability of each target (from any rank that computed it: the tp ranks agree).
std::vector<std::vector<double>> logprobs_of(const Documents& d, const torch::Tensor& rows) {
  std::vector<std::vector<double>> lp(d.ends.size());
  for (size_t q = 0; q < lp.size(); ++q) {
    lp[q].assign(static_cast<size_t>(std::max<int64_t>(0, d.ends[q] - doc_begin(d, q) - 1)), NAN);
  }
  const torch::Tensor r = rows.contiguous();
  const double* v = r.data_ptr<double>();
  for (int64_t i = 0; i < r.size(0); ++i) {
    const auto q = static_cast<size_t>(v[3 * i]), pos = static_cast<size_t>(v[3 * i + 1]);
    if (q < lp.size() && pos < lp[q].size() && std::isnan(lp[q][pos])) lp[q][pos] = -v[3 * i + 2];
  }
  return lp;
}

// Rank 0: one JSON line per sequence into `path`: its index, tokens, counted
// targets (the loss mask's), their summed log-probability, and with
// `per_token` every target's (and, under a mask, which count).
void write_scores(const Documents& d, const std::vector<std::vector<double>>& lp, const std::string& path,
                  bool per_token, const std::string& prefix) {
  if (!fs::path(path).parent_path().empty()) fs::create_directories(fs::path(path).parent_path());
  std::ofstream f(path);
  if (!f) throw UserError("--out " + path + ": cannot write the file; give --out a file in a folder composer can write");
  double total = 0;
  int64_t counted_all = 0;
  for (size_t q = 0; q < lp.size(); ++q) {
    double sum = 0;
    int64_t counted = 0;
    std::vector<int> mask;
    for (size_t j = 0; j < lp[q].size(); ++j) {
      TORCH_INTERNAL_ASSERT(!std::isnan(lp[q][j]), "no rank scored target ", j, " of sequence ", q);
      const bool in = d.counted(doc_begin(d, q) + static_cast<int64_t>(j) + 1);
      mask.push_back(in ? 1 : 0);
      if (!in) continue;
      sum += lp[q][j];
      ++counted;
    }
    nlohmann::ordered_json line = {{"index", q}, {"tokens", d.ends[q] - doc_begin(d, q)}, {"targets", counted},
                                   {"logprob", sum}};
    if (per_token) line["token_logprobs"] = lp[q];
    if (per_token && !d.mask.empty()) line["counted"] = mask;
    f << line.dump() << "\n";
    total += sum;
    counted_all += counted;
  }
  if (!f) throw RuntimeFailure("cannot write " + path);
  std::cout << prefix << "scored " << lp.size() << " sequences, " << counted_all << " targets"
            << (d.mask.empty() ? "" : " (the loss mask's)") << ": mean log-probability per target "
            << (counted_all ? total / static_cast<double>(counted_all) : 0.0) << "; wrote " << path << "\n";
}

}  // namespace

void check_score_options(const CliOptions& o) {
  if (o.score.data.empty()) {
    throw UserError("composer score needs --data FILE: a token file with its document index FILE.docs (one "
                    "sequence per document; tools/prepare-data writes both); see composer score --help");
  }
}

void check_score_data(const CliOptions& o, const ExperimentConfig& c) {
  score_documents(o.score.data, c, shape_data_plan(c));
  if (o.exporting.weights.empty()) return;
  nn::ShapeOnly shapes;  // --weights: every parameter of the model (adapters too), with its shape
  WeightSource::file(o.exporting.weights)->match(*build_model(c));
}

int run_score(const CliOptions& o, const ExperimentConfig& c, const Plan& plan, RankContext& rank) {
  torch::set_num_threads(rank_threads(c.train, rank.local_world_size));
  GoldenStart weights{o.exporting.weights};  // --weights: a file of every parameter in place of the config's start
  RankModel rm = build_rank_model(c, plan, rank, /*out_dir=*/"", weights.path.empty() ? nullptr : &weights);
  if (rm.data.inputs != InputKind::kTokens) {
    throw UserError("composer score gives the log-probability of token sequences; model " + c.model.name +
                    " takes float features (data.inputs " + name_of(rm.data.inputs) + ")");
  }
  const Documents d = score_documents(o.score.data, c, rm.data);
  const std::string out = o.out.empty() ? "runs/" + c.name + "/scores.jsonl" : o.out;
  rm.model->eval();
  if (rm.par.fsdp) rm.par.fsdp->set_forward_only(true);
  const int64_t global = c.train.global_batch, local = plan.local_batch;
  const int64_t begin = (rm.par.dp ? rm.par.dp->rank : 0) * local;
  const int64_t batches = (static_cast<int64_t>(d.ends.size()) + global - 1) / global;
  std::vector<torch::Tensor> mine;
  for (int64_t s = 0; s < batches; ++s) {
    const ScoreBatch b = score_batch(d, s * global + begin, local, rm.data.seq_len, rank.device);
    torch::Tensor rows = score_tokens(*rm.model, rm.par, plan.local_microbatch, b.batch, b.positions);
    rows.select(1, 0).add_(static_cast<double>(s * global + begin));  // the row's sequence
    mine.push_back(rows);
    if (rank.is_main() && (s + 1 == batches || (s + 1) % std::max<int64_t>(1, batches / 10) == 0)) {
      std::cout << rank.log_prefix << "score: batch " << s + 1 << " of " << batches << std::endl;
    }
  }
  const torch::Tensor all = gather_rows(rm.par.world, rank.rank, mine.empty() ? torch::empty({0, 3}, torch::kDouble)
                                                                              : torch::cat(mine));
  if (rank.is_main()) write_scores(d, logprobs_of(d, all), out, o.score.per_token, rank.log_prefix);
  return 0;
}

}  // namespace composer
