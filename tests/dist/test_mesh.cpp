// The device mesh: row-major rank arithmetic and real process groups per slice.
#include <gtest/gtest.h>

#include "parallelisms/comm/collectives.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

TEST(MeshMath, RowMajorGroups) {
  // (dp=2, tp=2): tp groups {0,1},{2,3}; dp groups {0,2},{1,3} (docs/scenarios.md).
  EXPECT_EQ(group_ranks(0, {2, 2}, {1}), (std::vector<int>{0, 1}));
  EXPECT_EQ(group_ranks(3, {2, 2}, {1}), (std::vector<int>{2, 3}));
  EXPECT_EQ(group_ranks(1, {2, 2}, {0}), (std::vector<int>{1, 3}));
  EXPECT_EQ(group_ranks(5, {2, 2, 2}, {0, 2}), (std::vector<int>{0, 1, 4, 5}));
  EXPECT_EQ(group_ranks(6, {2, 2, 2}, {1}), (std::vector<int>{4, 6}));
  EXPECT_EQ(coords_of(5, {2, 2, 2}), (std::vector<int64_t>{1, 0, 1}));
}

TEST(Mesh, TwoDimGroupsReduceOverTheirMembersOnly) {
  testing::run_ranks({"dp", "tp"}, {2, 2}, [](DeviceMesh& mesh) {
    auto t = torch::tensor({static_cast<float>(mesh.rank())});
    all_reduce(mesh.group("tp"), t);
    const int tp_base = mesh.rank() / 2 * 2;
    EXPECT_EQ(t.item<float>(), static_cast<float>(tp_base + tp_base + 1));
    auto d = torch::tensor({static_cast<float>(mesh.rank())});
    all_reduce(mesh.group("dp"), d);
    EXPECT_EQ(d.item<float>(), static_cast<float>(mesh.rank() % 2 + mesh.rank() % 2 + 2));
    auto w = torch::ones({1});
    all_reduce(mesh.world(), w);
    EXPECT_EQ(w.item<float>(), 4.0f);
    EXPECT_EQ(mesh.group("dp").size, 2);
    EXPECT_EQ(mesh.group("tp").rank, mesh.rank() % 2);
  });
}

TEST(Mesh, FlattenedGroupSpansSeveralDims) {
  testing::run_ranks({"a", "b", "c"}, {2, 1, 2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group(std::vector<std::string>{"a", "c"});
    EXPECT_EQ(g.size, 4);
    auto t = torch::ones({1});
    all_reduce(g, t);
    EXPECT_EQ(t.item<float>(), 4.0f);
    EXPECT_EQ(mesh.group("b").size, 1);
    EXPECT_EQ(mesh.group("b").pg, nullptr);
  }, {{"a", "c"}});
}

}  // namespace
}  // namespace composer::parallel
