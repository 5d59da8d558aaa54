// A run's line of checkpoints (checkpoint/lineage.h): pure functions, against histories
// written out by hand.
#include "lineage.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace zeroshard::ckpt {
namespace {

using json = nlohmann::json;

// Saved on line a from the start, a load of step 800 then saves on b, a load of b's 1200 on c.
json three_lines() { return branched(branched(fresh_lineage("a"), 800, "b"), 1200, "c"); }

TEST(Lineage, AStepIsInTheHistoryOfItsLineBetweenBranchPoints) {
  const json h = three_lines();
  EXPECT_EQ(h, json::parse(R"([{"line":"a","after":-1},{"line":"b","after":800},{"line":"c","after":1200}])"));
  EXPECT_TRUE(in_history(h, 0, "a"));
  EXPECT_TRUE(in_history(h, 800, "a"));
  EXPECT_FALSE(in_history(h, 900, "a")) << "a's timeline after the branch at 800 (what the rollback left)";
  EXPECT_TRUE(in_history(h, 800, "b")) << "the loaded step saved again on the new line is the same state";
  EXPECT_TRUE(in_history(h, 1000, "b"));
  EXPECT_FALSE(in_history(h, 1300, "b"));
  EXPECT_FALSE(in_history(h, 700, "b")) << "b began at 800";
  EXPECT_TRUE(in_history(h, 5000, "c"));
  EXPECT_FALSE(in_history(h, 1000, "d")) << "another job's line";
  EXPECT_FALSE(in_history(h, 100, "")) << "a commit before lines is not in a history that began with a line";
}

TEST(Lineage, ManifestsSavedBeforeLinesAreLineEmpty) {
  const json old{{"step", 300}};
  EXPECT_EQ(line_of(old), "");
  const json h = branched(lineage_of(old), 300, "n");
  EXPECT_TRUE(in_history(h, 300, ""));
  EXPECT_TRUE(in_history(h, 100, ""));
  EXPECT_FALSE(in_history(h, 400, ""));
  EXPECT_TRUE(in_history(h, 400, "n"));
  EXPECT_EQ(line_of(json{{"lineage", h}}), "n");
}

TEST(Lineage, AMalformedLineageIsRefusedByName) {
  for (const char* bad : {R"([])", R"("a")", R"([{"line":"a"}])", R"([{"line":1,"after":-1}])",
                          R"([{"line":"a","after":5},{"line":"b","after":5}])"}) {
    const std::string m = testing::error_of([&] { lineage_of(json{{"lineage", json::parse(bad)}}); });
    EXPECT_NE(m.find("lineage"), std::string::npos) << bad << ": " << m;
    EXPECT_NE(m.find("corrupt or was edited"), std::string::npos) << bad << ": " << m;
  }
}

TEST(Lineage, LineIdsAreSixteenHexDigitsAndDiffer) {
  const std::string a = new_line_id(), b = new_line_id();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace zeroshard::ckpt
