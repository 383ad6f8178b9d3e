// composer-tensorboard DIR: writes the TensorBoard event file in DIR that
// composer feeds it through standard input, one JSON line per event:
// {"step": N, "scalars": [["loss", 0.5], ...]}. Prints the file's path, then
// exits at the end of its input. A separate program because LibTorch's library
// exports an older protobuf's symbols than the one the messages are built with.
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "runner/observe/tensorboard_events.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: composer-tensorboard DIR (events as JSON lines on standard input)\n";
    return 2;
  }
  try {
    composer::tensorboard_events::EventFile file(argv[1]);
    std::cout << file.path() << std::endl;
    std::string line;
    while (std::getline(std::cin, line)) {
      const auto j = nlohmann::json::parse(line);
      std::vector<std::pair<std::string, double>> values;
      for (const auto& v : j.at("scalars")) values.emplace_back(v.at(0).get<std::string>(), v.at(1).get<double>());
      file.scalars(j.at("step").get<int64_t>(), values);
    }
  } catch (const std::exception& e) {
    std::cerr << "composer-tensorboard: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
