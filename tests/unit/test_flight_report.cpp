// The flight recorder's report: from rings written as ranks would write them,
// the findings name the mismatch, the rank behind and its operation; and a
// ring mapped in a file reads back as it was recorded.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "parallelisms/comm/mesh.h"
#include "runner/launch/flight_report.h"
#include "temp_path.h"

namespace composer {
namespace {

using parallel::FlightRecord;

FlightRecord op(uint64_t id, uint64_t seq, const char* kind, const char* group, int64_t bytes, int peer = -1,
                const char* site = "") {
  FlightRecord r;
  r.id = id;
  r.seq = seq;
  r.bytes = bytes;
  r.peer = peer;
  r.issued_ns = 1;
  r.finished_ns = 2;
  std::strncpy(r.kind, kind, sizeof r.kind - 1);
  std::strncpy(r.group, group, sizeof r.group - 1);
  std::strncpy(r.dtype, "float", sizeof r.dtype - 1);
  std::strncpy(r.site, site, sizeof r.site - 1);
  return r;
}

TEST(FlightReport, NamesAMismatchWithBothRanksAndKinds) {
  // Rank 1 skipped all_reduce #2 on dp: its #2 is the next reduce_scatter.
  RankFlight r0{0, 2, {op(1, 1, "all_gather", "dp[0,1]", 64), op(2, 2, "all_reduce", "dp[0,1]", 16)}};
  RankFlight r1{1, 2, {op(1, 1, "all_gather", "dp[0,1]", 64), op(2, 2, "reduce_scatter", "dp[0,1]", 32)}};
  r0.records[1].finished_ns = 0;  // rank 0 waits in it
  const auto f = flight_findings({r0, r1});
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f[0].rfind("mismatch on dp[0,1] at collective #2: rank 0 issued all_reduce (16 B float", 0), 0u) << f[0];
  EXPECT_NE(f[0].find("rank 1 issued reduce_scatter (32 B float"), std::string::npos) << f[0];
}

TEST(FlightReport, TakesAnAllToAllOfEachRanksOwnCountsForOneCollective) {
  // expert_parallel's dispatch: each rank sends its own rows; only a different kind is a mismatch.
  RankFlight r0{0, 2, {op(1, 1, "all_to_all", "ep[0,1]", 261120), op(2, 2, "all_to_all", "ep[0,1]", 64)}};
  RankFlight r1{1, 2, {op(1, 1, "all_to_all", "ep[0,1]", 263168), op(2, 2, "all_reduce", "ep[0,1]", 64)}};
  const auto f = flight_findings({r0, r1});
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].rfind("mismatch on ep[0,1] at collective #2: rank 0 issued all_to_all (64 B float", 0), 0u) << f[0];
}

TEST(FlightReport, NamesTheRankBehindAndTheCollectiveItHasNotIssued) {
  RankFlight r0{0, 3, {op(1, 1, "all_reduce", "world[0,1,2]", 8), op(2, 2, "all_reduce", "world[0,1,2]", 8, -1, "grad norm")}};
  RankFlight r1 = r0;
  r1.rank = 1;
  RankFlight r2{2, 3, {op(1, 1, "all_reduce", "world[0,1,2]", 8)}};
  for (RankFlight* r : {&r0, &r1}) {  // ranks 0 and 1 wait in #2
    r->records[1].waited_ns = 1;
    r->records[1].finished_ns = 0;
  }
  const auto f = flight_findings({r0, r1, r2});
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0], "rank 2 is behind on world[0,1,2]: it issued 1 collectives there, rank 0 issued 2; the first it has "
                  "not issued: #2 all_reduce (8 B float, grad norm, step 0)");
}

TEST(FlightReport, NamesTheSenderAReceiveWaitsFor) {
  RankFlight r0{0, 1, {op(1, 1, "send", "pp[0,1]", 128, 1, "SEND_F0.0")}};
  RankFlight r1{1, 1, {op(1, 1, "recv", "pp[0,1]", 128, 0, "RECV_F1.0"), op(2, 2, "recv", "pp[0,1]", 128, 0, "RECV_F1.1")}};
  r1.records[1].waited_ns = 1;  // rank 1 waits in it
  r1.records[1].finished_ns = 0;
  const auto f = flight_findings({r0, r1});
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0], "rank 0 is behind on pp[0,1]: rank 1 waits in recv #2 from it recv (128 B float, RECV_F1.1, step 0), "
                  "which it has not issued; its last send to rank 1 is #1");
}

// A pipeline of 4 whose rank 0 froze in compute: rank 1 waits in a receive
// from it, rank 2 in one from rank 1, rank 3 from rank 2. Rank 0 also posted
// a receive from rank 1 ahead, which it is not waiting in. Only rank 0 is
// behind; ranks 1 and 2 are held up.
TEST(FlightReport, NamesTheHeadOfAChainOfWaitsBehindAndTheRestHeldUp) {
  auto blocked = [](FlightRecord r) {
    r.waited_ns = 1;
    r.finished_ns = 0;
    return r;
  };
  FlightRecord ahead = op(2, 1, "recv", "pp[0,1]", 64, 1, "RECV_B0.0");
  ahead.finished_ns = 0;  // posted, not waited for
  RankFlight r0{0, 1, {op(1, 1, "send", "pp[0,1]", 64, 1, "SEND_F0.0"), ahead}};
  RankFlight r1{1, 1, {op(1, 1, "recv", "pp[0,1]", 64, 0, "RECV_F1.0"), op(2, 1, "send", "pp[1,2]", 64, 2),
                       blocked(op(3, 2, "recv", "pp[0,1]", 64, 0, "RECV_F1.1"))}};
  RankFlight r2{2, 1, {op(1, 1, "recv", "pp[1,2]", 64, 1), blocked(op(2, 2, "recv", "pp[1,2]", 64, 1, "RECV_F2.1"))}};
  RankFlight r3{3, 1, {blocked(op(1, 1, "recv", "pp[2,3]", 64, 2, "RECV_F3.0"))}};
  const auto f = flight_findings({r0, r1, r2, r3});
  ASSERT_EQ(f.size(), 3u) << ::testing::PrintToString(f);
  EXPECT_EQ(f[0].rfind("rank 0 is behind on pp[0,1]: rank 1 waits in recv #2 from it", 0), 0u) << f[0];
  int behind = 0, held = 0;
  for (const auto& line : f) {
    behind += line.find(" is behind ") != std::string::npos;
    held += line.find(" is held up (it waits for rank ") != std::string::npos;
    EXPECT_NE(line.rfind("rank 3 ", 0), 0u) << line;  // rank 3 only waits
  }
  EXPECT_EQ(behind, 1);  // rank 0 alone (rank 0's receive posted ahead counts against nobody)
  EXPECT_EQ(held, 2);    // ranks 1 and 2 are held up
}

// Rank 1 froze after issuing its send: rank 0 waits in the matching
// receive, and rank 1 waits in nothing: it holds the transfer up.
TEST(FlightReport, NamesARankThatIssuedButWaitsInNothing) {
  RankFlight r0{0, 1, {op(1, 1, "recv", "pp[0,1]", 64, 1, "RECV_B0.0")}};
  r0.records[0].waited_ns = 1;
  r0.records[0].finished_ns = 0;
  RankFlight r1{1, 1, {op(1, 1, "send", "pp[0,1]", 64, 0, "SEND_B1.0")}};
  r1.records[0].finished_ns = 0;
  const auto f = flight_findings({r0, r1});
  ASSERT_EQ(f.size(), 1u) << ::testing::PrintToString(f);
  EXPECT_EQ(f[0].rfind("rank 1 is behind on pp[0,1]: it has not completed #1 send", 0), 0u) << f[0];
  EXPECT_NE(f[0].find("in which rank 0 waits"), std::string::npos) << f[0];
}

TEST(FlightReport, SaysSoWhenEveryRankIssuedTheSame) {
  RankFlight r0{0, 1, {op(1, 1, "all_reduce", "dp[0,1]", 8)}};
  RankFlight r1{1, 1, {op(1, 1, "all_reduce", "dp[0,1]", 8)}};
  EXPECT_TRUE(flight_findings({r0, r1}).empty());
  r1.records[0].finished_ns = 0;
  const auto f = flight_findings({r0, r1});
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].rfind("every rank issued the same operations; rank 1 has not finished #1 all_reduce", 0), 0u) << f[0];
}

FlightRecord blocked(FlightRecord r, int64_t at) {
  r.issued_ns = r.waited_ns = at;
  r.finished_ns = 0;
  return r;
}

// Tensor parallel: rank 2 of 4 froze inside all_reduce #5 after its peers
// entered it; the rings alone cannot tell it from the ranks that wait, but
// the launcher saw its process stopped: it alone is named, and where.
TEST(FlightReport, NamesAStoppedRankInsideAnOperationEveryRankWaitsIn) {
  std::vector<RankFlight> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(
        {r,
         3,
         {op(1, 4, "all_reduce", "tp[0,1,2,3]", 64), blocked(op(2, 5, "all_reduce", "tp[0,1,2,3]", 64), 10 + r)}});
  }
  ranks[2].stopped = SIGSTOP;
  const auto f = flight_findings(ranks);
  ASSERT_EQ(f.size(), 1u) << ::testing::PrintToString(f);
  EXPECT_EQ(f[0].rfind("rank 2 is frozen (its process was stopped by signal 19 (SIGSTOP) until the job ended", 0), 0u)
      << f[0];
  EXPECT_NE(f[0].find("): it stopped inside #5 all_reduce (64 B float, step 0) on tp[0,1,2,3], in which ranks 0, 1 "
                      "and 3 wait"),
            std::string::npos)
      << f[0];
}

// Fully sharded over 4: rank 1 froze while computing, before all_gather #7;
// ranks 0 and 2 wait in #7, and rank 3, waiting in #7 too, has not yet
// issued the prefetch #8 ranks 0 and 2 wait in. Only rank 1 is named,
// behind on #7: not rank 3, which the rings alone would call behind on #8.
TEST(FlightReport, NamesAStoppedRankBehindAndNoRankItHoldsUp) {
  const char* dp = "dp[0,1,2,3]";
  auto ring = [&](int rank, bool prefetched) {
    RankFlight r{rank, 2, {op(1, 6, "all_gather", dp, 64), blocked(op(2, 7, "all_gather", dp, 64), 20)}};
    if (prefetched) r.records.push_back(blocked(op(3, 8, "all_gather", dp, 64), 21));
    return r;
  };
  RankFlight r1{1, 2, {op(1, 6, "all_gather", dp, 64)}};
  r1.stopped = SIGSTOP;
  const std::vector<RankFlight> ranks{ring(0, true), r1, ring(2, true), ring(3, false)};
  const auto f = flight_findings(ranks);
  ASSERT_EQ(f.size(), 1u) << ::testing::PrintToString(f);
  EXPECT_EQ(f[0].rfind("rank 1 is frozen (", 0), 0u) << f[0];
  EXPECT_NE(f[0].find("): it is behind on dp[0,1,2,3]: it issued 6 collectives there"), std::string::npos) << f[0];
  std::vector<RankFlight> rings_alone = ranks;
  rings_alone[1].stopped = 0;
  int rank3 = 0;
  for (const auto& line : flight_findings(rings_alone)) rank3 += line.rfind("rank 3 is behind", 0) == 0;
  EXPECT_EQ(rank3, 1);
}

TEST(FlightRecorder, AMappedRingReadsBackAndWraps) {
  const std::string path = testing::temp_path("flight.bin");
  parallel::Group g;
  g.name = "dp";
  g.ranks = {0, 1};
  g.size = 2;
  {
    parallel::FlightRecorder rec(1, 3, path);
    parallel::mark_training_thread();
    for (int i = 0; i < 4; ++i) {
      parallel::CommSite site("unit " + std::to_string(i));
      const uint64_t id = rec.issue(g, i == 3 ? "send" : "all_reduce", i == 3 ? 0 : -1, 100 + i, torch::kFloat);
      if (i < 3) rec.finished(id);
    }
    rec.set_step(7);
    int rank = -1;
    int64_t step = -1;
    const auto back = parallel::FlightRecorder::read_file(path, &rank, &step);  // while it is still mapped
    EXPECT_EQ(rank, 1);
    EXPECT_EQ(step, 7);
    ASSERT_EQ(back.size(), 3u);  // the oldest of 4 was overwritten
    EXPECT_EQ(back[0].id, 2u);
    EXPECT_EQ(back[0].seq, 2u);
    EXPECT_STREQ(back[1].site, "unit 2");
    EXPECT_STREQ(back[2].kind, "send");
    EXPECT_EQ(back[2].peer, 0);
    EXPECT_EQ(back[2].seq, 1u);  // the first send to rank 0
    EXPECT_EQ(back[2].finished_ns, 0);
    EXPECT_GT(back[1].finished_ns, 0);
    EXPECT_STREQ(back[2].group, "dp[0,1]");
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace composer
