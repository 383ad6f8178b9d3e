// The rank environment under SLURM: the first host of a node list, in the
// bracket syntax SLURM writes.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace composer
