// text_file.h — a whole text file written, or an error naming it.
#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace bart {

// Writes `text` to `path` (replacing it) and checks that all of it went out:
// a full disk or a file size limit throws, naming `who` ("prepare") and the
// file, instead of leaving a truncated file for a rename to commit.
inline void write_text_file(const std::filesystem::path& path, std::string_view text, const char* who) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out, who, ": cannot create '", path.string(), "': ", std::strerror(errno));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  TORCH_CHECK(out.good(), who, ": writing '", path.string(), "' failed (", std::strerror(errno),
              "; a full disk?): nothing was committed; free space and run it again");
}

}  // namespace bart
