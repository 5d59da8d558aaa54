#include "zeroshard/version.h"

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)

namespace zeroshard {

const char* version() {
  return ZS_STR(ZEROSHARD_VERSION_MAJOR) "." ZS_STR(ZEROSHARD_VERSION_MINOR) "." ZS_STR(ZEROSHARD_VERSION_PATCH);
}

}  // namespace zeroshard
