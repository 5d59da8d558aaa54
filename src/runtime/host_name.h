// host_name.h — this host's name, as messages, device groups and checkpoints name hosts.
#pragma once

#include <string>

namespace zeroshard {

// gethostname(), or "(unnamed)" where it fails.
std::string host_name();

}  // namespace zeroshard
