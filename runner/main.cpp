// composer: parse the command line, load and plan the experiment, run it.
// The only place where an exception becomes an exit code.
#include <iostream>

#include "runner/cli.h"
#include "runner/errors.h"

int main(int argc, char** argv) {
  using namespace composer;
  try {
    CliOptions options = parse_cli(argc, argv);
    if (options.exit_now) return 0;
    ExperimentConfig config = load_config(options.config, options.sets);
    Plan plan = make_plan(config, config.mesh.world_size());
    return run_command(options, config, plan);
  } catch (const UserError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  } catch (const CheckFailed& e) {
    std::cerr << "check failed: " << e.what() << "\n";
    return 1;
  } catch (const RuntimeFailure& e) {
    std::cerr << "runtime failure: " << e.what() << "\n";
    return 3;
  } catch (const c10::Error& e) {
    std::cerr << "runtime failure: " << e.what_without_backtrace() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "runtime failure: " << e.what() << "\n";
    return 3;
  }
}
