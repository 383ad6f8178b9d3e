#include "runner/config/field_walk.h"

namespace composer {

SourceRef ref_at(YamlMap& m, const std::string& key) {
  if (key.find_first_of(".[") == std::string::npos) return m.ref(key);
  YAML::Node node;  // reset, not assigned: a YAML::Node assigned to writes into the document
  node.reset(m.node(key.substr(0, key.find_first_of(".["))));
  std::string path = m.child_path(key.substr(0, key.find_first_of(".[")));
  size_t at = key.find_first_of(".[");
  while (at < key.size()) {
    if (key[at] == '[') {
      const size_t close = key.find(']', at);
      const size_t i = std::stoul(key.substr(at + 1, close - at - 1));
      if (node.IsSequence()) {  // a mapping written alone stands for a list of one
        node.reset(static_cast<const YAML::Node&>(node)[i]);
        path += key.substr(at, close + 1 - at);
      }
      at = close + 1;
      continue;
    }
    const size_t end = key.find_first_of(".[", at + 1);
    const std::string step = key.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
    node.reset(node.IsMap() ? static_cast<const YAML::Node&>(node)[step] : YAML::Node());
    path += "." + step;
    at = end == std::string::npos ? key.size() : end;
  }
  return ref_of(node, path, m.context());
}

}  // namespace composer
