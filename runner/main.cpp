// composer: parse the command line, load and plan the experiment, then either
// start the ranks (a multi-rank mesh without an external launcher) or run as
// one rank. The only place where an exception becomes an exit code.
#include <cstdlib>
#include <iostream>

#include "runner/cli.h"
#include "runner/errors.h"

namespace composer {
namespace {

int run(int argc, char** argv) {
  CliOptions options = parse_cli(argc, argv);
  if (options.exit_now) return 0;
  ExperimentConfig config = load_config(options.config, options.sets);
  Plan plan = make_plan(config, config.mesh.world_size());
  std::optional<RankEnv> env = rank_env_from_environment();
  if (options.command == Command::kPlan || (!env && plan.world_size == 1)) {
    RankContext rank = single_rank();
    return run_command(options, config, plan, rank);
  }
  if (!env) return launch_local_ranks(static_cast<int>(plan.world_size), options.node, options.argv);
  RankContext rank = join_job(*env, config, plan);
  if (!std::getenv("COMPOSER_LAUNCHED")) {  // composer's launcher prefixes lines itself
    rank.log_prefix = "[rank " + std::to_string(rank.rank) + "/" + std::to_string(rank.world_size) + "] ";
  }
  return run_command(options, config, plan, rank);
}

}  // namespace
}  // namespace composer

int main(int argc, char** argv) {
  using namespace composer;
  try {
    return run(argc, argv);
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
