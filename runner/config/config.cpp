// Reading a config: the YAML document, one walk over ExperimentConfig's field
// lists (runner/config/field_walk.h), and the two readers of its own that the
// walk calls: model.args from the model registry and the rules across sections.
#include "runner/config/config.h"

#include <yaml-cpp/depthguard.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <tuple>

#include "models/registry.h"
#include "runner/config/config_delay.h"
#include "runner/config/config_document.h"
#include "runner/config/hf_config.h"
#include "runner/config/yaml_reader.h"

namespace composer {
namespace {

models::ArgValue read_arg(YamlMap& m, const models::ArgSpec& spec) {
  switch (spec.type) {
    case models::ArgType::kInt: return m.convert<int64_t>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kFloat: return m.convert<double>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kBool: return m.convert<bool>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kString:
      if (m.node(spec.name).IsSequence()) {  // e.g. a list where the argument takes one text: "0, 2"
        throw ConfigError(m.ref(spec.name), "expected text, not a list: " + spec.name + " is " + spec.doc);
      }
      return m.convert<std::string>(m.node(spec.name), m.child_path(spec.name));
  }
  return int64_t{0};
}

// The registry entry of model.name (already read from `model`).
const models::ModelSpec& model_spec(YamlMap& model, const std::string& name) {
  if (const models::ModelSpec* spec = models::find_model(name)) return *spec;
  auto names = models::model_names();
  std::string hint = nearest(name, names);
  throw ConfigError(model.ref("name"), "unknown model '" + name + "'" +
                                           (hint.empty() ? "" : "; did you mean " + hint + "?") +
                                           " known models: " + YamlMap::join(names));
}

// from_hf's refusals: a model without a Hugging Face adapter, or init_from beside it.
void check_from_hf(YamlMap& model, const models::ModelSpec& spec) {
  if (!spec.hf) {
    const std::string with = models::listed_names_with(models::Capability::kHuggingFace);
    throw ConfigError(model.ref("name"), "model " + spec.name + " has no Hugging Face adapter; from_hf reads "
                                         "Hugging Face folders into model " + with + "; set model.name to it");
  }
  if (model.has("init_from")) {
    throw ConfigError(model.ref("init_from"), "init_from and from_hf both give the initial weights; keep one");
  }
}

// data.documents.eos_id against the model's vocabulary: an id the model never sees would end no document.
std::optional<FieldError> eos_id_error(const ModelConfig& model, const DocumentsConfig& d) {
  const auto& args = model.args.values();
  const auto vocab = args.find("vocab_size");
  if (d.eos_id < 0 || vocab == args.end() || !std::holds_alternative<int64_t>(vocab->second)) return std::nullopt;
  const int64_t size = std::get<int64_t>(vocab->second);
  if (d.eos_id < size) return std::nullopt;
  const std::string from =
      model.from_hf.empty() ? "model.args.vocab_size" : "vocab_size in " + model.from_hf + "/config.json";
  return FieldError{"data.documents.eos_id",
                    "eos_id " + std::to_string(d.eos_id) + " is not a token id of model " + model.name +
                        ", whose vocab_size is " + std::to_string(size) + " (" + from + ", ids 0 to " +
                        std::to_string(size - 1) +
                        "); give the id that ends each document in the token files, or leave eos_id out to read "
                        "each file's document index"};
}

// model.lora_from: the adapters of train.lora, on the Hugging Face base from_hf reads.
std::optional<FieldError> lora_from_error(const ModelConfig& model, const TrainConfig& train) {
  if (model.lora_from.empty()) return std::nullopt;
  if (!train.lora) {
    return FieldError{"model.lora_from", "lora_from gives train.lora's adapters their starting values, and this "
                                         "config has no train.lora; add train.lora with the adapter's rank, alpha "
                                         "and targets, or remove lora_from"};
  }
  if (model.from_hf.empty()) {
    return FieldError{"model.lora_from", "lora_from reads a PEFT adapter of a Hugging Face base, named by its "
                                         "modules; give model.from_hf: the base's folder (the one the adapter was "
                                         "trained on)"};
  }
  return std::nullopt;
}

// debug's ranks against the mesh, and its faults against what the run has.
std::optional<FieldError> debug_error(const DebugConfig& d, int64_t world_size, bool documents, bool muon) {
  if (d.inject_rank < 0 || d.inject_rank >= world_size) {
    return FieldError{"debug.inject_rank", "inject_rank " + std::to_string(d.inject_rank) + " is not a rank of the " +
                                               std::to_string(world_size) + "-rank mesh; use 0 .. " +
                                               std::to_string(world_size - 1)};
  }
  if (d.inject == Inject::kNoDocumentMask && !documents) {
    return FieldError{"debug.inject", "no_document_mask drops data.documents' mask, and this run packs no "
                                      "documents; set data.documents: {mask: true} or inject another fault"};
  }
  if (d.inject == Inject::kMuonLocalPiece && !muon) {
    return FieldError{"debug.inject", "muon_local_piece breaks Muon's whole-matrix orthogonalisation, and this run's "
                                      "optimizer is not muon; set train.optimizer.name: muon or inject another fault"};
  }
  if (d.inject == Inject::kSkipCollective && world_size < 2) {
    return FieldError{"debug.inject", "skip_collective leaves out a collective, which needs a mesh of at least 2 "
                                      "ranks; give mesh.shape more ranks or remove it"};
  }
  if (auto e = delay_ranks_error(d.delay, world_size)) return FieldError{"debug." + e->key, e->message};
  return std::nullopt;
}

}  // namespace

// model.args: each argument of name's registry entry, given or its default;
// with from_hf, config.json gives them (only the adapter's yaml_args() may be written).
void read_value(YamlMap& model, const std::string& key, models::ModelArgs& args) {
  std::string name;
  model.require("name", name);
  const models::ModelSpec& spec = model_spec(model, name);
  std::string from_hf;
  model.get("from_hf", from_hf);
  const bool hf = model.has("from_hf");
  if (hf) check_from_hf(model, spec);
  const std::vector<std::string> settable = hf ? spec.hf->yaml_args() : std::vector<std::string>{};
  std::vector<std::string> written;  // of settable, what the YAML gave
  YamlMap given(model.has(key) ? model.node(key) : YAML::Node(), model.child_path(key), model.context());
  for (const auto& a : spec.args) {
    const bool may = std::find(settable.begin(), settable.end(), a.name) != settable.end();
    if (hf && given.has(a.name) && !may) {
      throw ConfigError(given.ref(a.name), "this argument comes from from_hf's config.json; remove it" +
                                               (settable.empty() ? std::string()
                                                                 : " (only " + YamlMap::join(settable) + " may be given)"));
    }
    if (given.has(a.name) && may) written.push_back(a.name);
    args.set(a.name, given.has(a.name) ? read_arg(given, a) : a.default_value);
    if (a.quiet_default) args.quiet_at(a.name, a.default_value);
  }
  given.finish();
  if (hf) naming_config_key(model.ref("from_hf"), [&] { read_hf_config(from_hf, spec, args, written); });
  if (!spec.check) return;
  try {
    spec.check(args);
  } catch (const models::ArgError& e) {
    throw ConfigError(given.has(e.arg()) ? given.ref(e.arg()) : given.self_ref(), e.what());
  }
}

nlohmann::json value_json(const models::ModelArgs& args) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, value] : args.values()) {
    if (!args.quiet(key)) std::visit([&, &key = key](const auto& x) { j[key] = x; }, value);
  }
  return j;
}

namespace {

// The rules across sections, and the defaults that depend on another section:
// eval.data's token width, the golden's path, eos_id within the vocabulary,
// profile.steps within train.steps, debug's ranks within the mesh. The error's
// key is a dotted path from the root.
std::optional<FieldError> across_sections(ExperimentConfig& c) {
  auto [name, check, eval, data, model, profile, train, debug, mesh] =
      std::tie(c.name, c.check, c.eval, c.data, c.model, c.profile, c.train, c.debug, c.mesh);
  if (name.empty() || name.find('/') != std::string::npos) {
    return FieldError{"name", "name must be a non-empty file name without '/'"};
  }
  check.golden = golden_path(c);  // the resolved config names the golden file it is checked against
  if (eval.data && eval.data->source == DataSource::kTokens && !eval.data->token_dtype) {
    eval.data->token_dtype = data.token_dtype.value_or(TokenDType::kUint16);  // the training data's width
  }
  if (auto e = eos_id_error(model, data.documents)) return e;
  if (auto e = lora_from_error(model, train)) return e;
  if (!profile.steps.empty()) {
    const auto& s = profile.steps;
    if (s.size() != 2 || s[0] < 1 || s[0] > s[1] || s[1] > train.steps) {
      return FieldError{"profile.steps", "steps must be [first, last] with 1 <= first <= last <= train.steps (" +
                                             std::to_string(train.steps) + "), e.g. [" +
                                             std::to_string(std::min<int64_t>(2, train.steps)) + ", " +
                                             std::to_string(std::min<int64_t>(3, train.steps)) + "]"};
    }
  }
  return debug_error(debug, mesh.world_size(), data.documents.active(),
                     train.optimizer.name == OptimizerKind::kMuon);
}

}  // namespace

int64_t MeshConfig::world_size() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

ExperimentConfig parse_config(const std::string& text, const std::string& file,
                              const std::vector<std::string>& overrides) {
  ReadContext ctx{file, {}};
  YAML::Node doc;
  try {
    doc = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {  // the parser's own bound, met before ours
    SourceRef r{file, e.mark.line + 1, e.mark.column + 1, "", ""};
    throw ConfigError(r, "the config nests deeper than " + std::to_string(e.depth()) + " levels here (lists or mappings "
                         "inside each other); a config may nest at most " + std::to_string(kMaxConfigDepth) +
                         " levels: write the values out flatter");
  } catch (const YAML::ParserException& e) {
    SourceRef r{file, e.mark.line + 1, e.mark.column + 1, "", ""};
    throw ConfigError(r, "malformed YAML: " + e.msg);
  }
  if (!doc.IsMap()) {
    throw ConfigError(SourceRef{file, 1, 1, "", ""},
                      "expected a mapping with the sections name, seed, model, mesh, parallelize, train, data, check");
  }
  check_unique_keys(doc, file);
  for (const auto& o : overrides) apply_override(doc, o, ctx);
  ExperimentConfig c;
  c.file = file;
  read_section(doc, "", ctx, c);
  if (auto e = across_sections(c)) {
    YamlMap root(doc, "", ctx);
    throw ConfigError(ref_at(root, e->key), e->message);
  }
  if (c.check.golden_ref.path.empty()) {  // check.golden not given: the name names the default golden
    c.check.golden_ref = ref_of(static_cast<const YAML::Node&>(doc)["name"], "name", ctx);
  }
  return c;
}

ExperimentConfig eval_data_config(const ExperimentConfig& c) {
  ExperimentConfig e = c;
  if (const auto& d = c.eval.data) {
    e.data.source = d->source;
    e.data.path = d->path;
    e.data.path_ref = d->path_ref;
    e.data.token_dtype = d->token_dtype;
    e.data.sources = d->sources;
  }
  if (c.eval.seq_len) e.data.seq_len = c.eval.seq_len;
  if (c.eval.global_batch) e.train.global_batch = c.eval.global_batch;  // a sample's global index counts in eval batches
  e.seed = c.seed ^ 0x6576616c2d736565ull;  // eval's own samples and windows, not training's
  return e;
}

ExperimentConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) throw FileError(path, "cannot read the config file; check the path");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

}  // namespace composer
