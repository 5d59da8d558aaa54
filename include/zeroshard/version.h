// zeroshard's version: of the headers a program compiles against (these macros)
// and of the library it links (zeroshard::version()). CMakeLists.txt takes the
// project's version from this file; the CMake package (find_package(zeroshard 0.2))
// and zeroshard.pc report the same.
#pragma once

#define ZEROSHARD_VERSION_MAJOR 0
#define ZEROSHARD_VERSION_MINOR 2
#define ZEROSHARD_VERSION_PATCH 0
// One number for preprocessor tests: major * 10000 + minor * 100 + patch (0.2.0 is 200).
#define ZEROSHARD_VERSION (ZEROSHARD_VERSION_MAJOR * 10000 + ZEROSHARD_VERSION_MINOR * 100 + ZEROSHARD_VERSION_PATCH)

namespace zeroshard {

// The version of the library linked, "major.minor.patch". A program built against
// the headers of another version sees a different string than ZEROSHARD_VERSION says.
const char* version();

}  // namespace zeroshard
