// TensorBoard's record framing: CRC-32C and its masked form. The event files
// themselves are read back by the tensorboard package (tests/cli/tensorboard_scalars.sh).
#include <gtest/gtest.h>

#include <cstring>

#include "runner/observe/tensorboard_events.h"

namespace composer::tensorboard_events {
namespace {

TEST(TensorBoard, Crc32cIsCastagnolis) {
  // The check value of CRC-32C (RFC 3720, B.4) and its all-zero vector.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const char zeros[32] = {};
  EXPECT_EQ(crc32c(zeros, sizeof zeros), 0x8A9136AAu);
}

TEST(TensorBoard, MaskedCrcRotatesAndAddsTheConstant) {
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

}  // namespace
}  // namespace composer::tensorboard_events
