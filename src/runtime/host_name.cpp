// host_name.cpp — this host's name.
#include "runtime/host_name.h"

#include <unistd.h>

namespace zeroshard {

std::string host_name() {
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string("(unnamed)");
}

}  // namespace zeroshard
