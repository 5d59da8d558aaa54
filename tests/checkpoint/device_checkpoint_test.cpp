// Checkpoints across devices: a run on the tests' device (ZS_TEST_DEVICE, over
// testing::test_group()) saves, a run on the CPU resumes it, and the reverse.
// In CI the tests' device is the CPU too (the save still goes through the host
// copier, synchronously and in the background); scripts/gpu-check.sh runs it
// with ZS_TEST_DEVICE=cuda, which makes it CPU <-> GPU both ways.
#include "checkpoint/checkpoint_models.h"

namespace zeroshard {
namespace checkpoint_test {

// Saved at kSaveAt on one device and loaded on the other: the parameters equal
// the saver's bit for bit, and training on to kEnd follows the saver's own
// trajectory to float rounding (the moments came across too: without them the
// first steps after the load move by ~lr, 1e-2).
void expect_resumes_across_devices(int stage, bool async) {
  const std::string dir = common_temp_dir("zs_ckpt_device");
  CheckpointOptions co;
  co.async = async;
  const auto here = testing::test_group();
  const ProcessGroup cpu = world_ptr();
  SCOPED_TRACE("stage " + std::to_string(stage) + (async ? " async" : " sync") + " on " + testing::test_setup());

  Trainer saver(stage, 1, here);
  saver.train(0, kSaveAt);
  const auto at_save = saver.flat();
  {
    Checkpointer c(dir + "/from-device", world_ptr(), co);
    saver.save(c, kSaveAt);
    saver.train(kSaveAt, kEnd);  // an async save overlaps this; its copies land before the first update
    c.wait();
  }
  const auto want = saver.flat();

  Trainer on_cpu(stage, 2, cpu);
  {
    Checkpointer c(dir + "/from-device", world_ptr(), co);
    ASSERT_TRUE(on_cpu.load(c).has_value());
  }
  EXPECT_TRUE(torch::equal(on_cpu.flat(), at_save)) << "the CPU run did not load the device run's values";
  {
    Checkpointer c(dir + "/from-cpu", world_ptr(), co);
    on_cpu.save(c, kSaveAt);
    c.wait();
  }
  on_cpu.train(kSaveAt, kEnd);
  expect_close(on_cpu.flat(), want);

  Trainer back(stage, 3, here);
  {
    Checkpointer c(dir + "/from-cpu", world_ptr(), co);
    ASSERT_TRUE(back.load(c).has_value());
  }
  EXPECT_TRUE(torch::equal(back.flat(), at_save)) << "the device run did not load the CPU run's values";
  back.train(kSaveAt, kEnd);
  expect_close(back.flat(), want);
  EXPECT_GT((want - at_save).abs().max().item<double>(), 1e-3) << "training after the save changed nothing";
}

TEST(CheckpointDevice, Stage2ResumesOnTheOtherDevice) { expect_resumes_across_devices(2, false); }
TEST(CheckpointDevice, Stage3ResumesOnTheOtherDeviceAfterAnAsyncSave) { expect_resumes_across_devices(3, true); }

}  // namespace checkpoint_test
}  // namespace zeroshard
