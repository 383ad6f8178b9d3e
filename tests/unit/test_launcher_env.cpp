// The rank environment under SLURM: the first host of a node list, in the
// bracket syntax SLURM writes. How the launcher reads a rank's end: a rank
// stopped and continued just before it exits ran to its end; one still
// stopped when killed was frozen.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "runner/launch/launcher.h"

namespace composer {
namespace {

TEST(SlurmNodeList, FirstHost) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("gpu[03-05,07],cpu1"), "gpu03");
  EXPECT_EQ(first_slurm_host("gpu[7,3-5]"), "gpu7");
  EXPECT_EQ(first_slurm_host("127.0.0.[1-4]"), "127.0.0.1");
  EXPECT_EQ(first_slurm_host("rack1-n[12]"), "rack1-n12");
}

// A child that stops itself, then (continued) exits with `code`.
pid_t stop_then_exit(int code) {
  const pid_t pid = fork();
  if (pid == 0) {
    raise(SIGSTOP);
    _exit(code);
  }
  return pid;
}

// Watches `p` until the launcher has seen it stopped.
void until_seen_stopped(RankProcess& p) {
  for (int i = 0; i < 1000 && !p.stopped; ++i) {
    ASSERT_FALSE(watch_process(p));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(p.stopped, SIGSTOP);
  EXPECT_TRUE(process_is_stopped(p.pid));
}

// Blocks until the child has exited, leaving it unreaped: its continue is
// never looked for, as when a launcher's poll comes after the exit.
void until_exited(pid_t pid) {
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);
}

TEST(WatchProcess, AStopThenAnExitIsARankThatRanToItsEnd) {
  for (int code : {0, 7}) {
    RankProcess p;
    p.pid = stop_then_exit(code);
    until_seen_stopped(p);
    kill(p.pid, SIGCONT);
    until_exited(p.pid);
    ASSERT_TRUE(watch_process(p));
    EXPECT_TRUE(p.done);
    EXPECT_FALSE(p.frozen);
    EXPECT_EQ(p.stopped, 0);
    EXPECT_EQ(p.code, code);
    EXPECT_EQ(p.signal, 0);
  }
}

TEST(WatchProcess, AStopThenADeathByAnotherSignalWasRunning) {
  RankProcess p;
  p.pid = stop_then_exit(0);
  until_seen_stopped(p);
  kill(p.pid, SIGTERM);  // held while it is stopped, delivered once it runs
  kill(p.pid, SIGCONT);
  until_exited(p.pid);
  ASSERT_TRUE(watch_process(p));
  EXPECT_FALSE(p.frozen);
  EXPECT_EQ(p.signal, SIGTERM);
  EXPECT_EQ(p.code, 128 + SIGTERM);
}

TEST(WatchProcess, ARankStillStoppedWhenKilledWasFrozen) {
  RankProcess p;
  p.pid = stop_then_exit(0);
  until_seen_stopped(p);
  kill(p.pid, p.sent = SIGKILL);
  until_exited(p.pid);
  ASSERT_TRUE(watch_process(p));
  EXPECT_TRUE(p.frozen);
  EXPECT_EQ(p.stopped, SIGSTOP);
  EXPECT_EQ(p.code, 128 + SIGKILL);
  EXPECT_EQ(p.signal, 0);  // the launcher's own signal
}

// What the launcher looks at before it kills a rank it last saw stopped.
TEST(WatchProcess, ProcessStateSaysStoppedOnlyWhileStopped) {
  const pid_t pid = fork();
  if (pid == 0) {
    raise(SIGSTOP);
    for (;;) pause();
  }
  RankProcess p;
  p.pid = pid;
  until_seen_stopped(p);
  kill(pid, SIGCONT);
  bool running = false;
  for (int i = 0; i < 1000 && !running; ++i) {
    running = !process_is_stopped(pid);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(running);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace
}  // namespace composer
