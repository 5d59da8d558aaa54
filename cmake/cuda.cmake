# The CUDA path: the kernels (nvcc) and NCCL, when LibTorch was built with CUDA.
#
# NCCL is the one LibTorch loads (the wheel's nvidia-nccl beside torch), headers
# and library together: a process holds one libnccl.so.2, so the headers we
# compile against must be its version. ZS_NCCL_ROOT overrides (a directory with
# include/nccl.h and lib/libnccl.so*).
#
# Defines: zeroshard_cuda (the kernels), ZS_NCCL_INCLUDE_DIR, ZS_NCCL_LIBRARY.

set(ZS_CUDA_ARCHITECTURES "90-real;90-virtual" CACHE STRING
    "GPU code to build: sm_90 machine code and compute_90 PTX (JIT-compiled for newer GPUs)")
set(ZS_NCCL_ROOT "" CACHE PATH "NCCL to build against (default: the one beside LibTorch, else the CUDA toolkit's)")

# The compiler is the nvcc CMakeLists.txt found (ZS_NVCC, cmake/find_nvcc.cmake), also
# when it is not on PATH. The architectures are ours: CMake's default-architecture probe
# is skipped, and an empty CMAKE_CUDA_ARCHITECTURES left in the cache by a failed
# configure cannot stop this one.
set(CMAKE_CUDA_COMPILER "${ZS_NVCC}" CACHE FILEPATH "The CUDA compiler (nvcc)" FORCE)
set(CMAKE_CUDA_ARCHITECTURES ${ZS_CUDA_ARCHITECTURES})
# The shared CUDA runtime: CMake's default is cudart_static, which a program linking
# zeroshard_cuda would carry beside the libcudart.so.N that LibTorch loads. The runtime a
# program links follows the program's CUDA_RUNTIME_LIBRARY (initialized from this
# variable), not the library's, so it is set for every target created from here on.
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
enable_language(CUDA)
set(CMAKE_CUDA_FLAGS "${_zs_user_cuda_flags}")
# torch::cudart is the wheel's libcudart (cmake/torch.cmake); our C++ files that include
# CUDA headers take the toolkit's, the ones nvcc compiles the kernels with.
if(TARGET torch::cudart AND ZS_TORCH STREQUAL "venv")
  set_property(TARGET torch::cudart APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
endif()

set(_zs_nccl_hints ${ZS_NCCL_ROOT})
if(DEFINED _zs_torch_dir)
  list(APPEND _zs_nccl_hints "${_zs_torch_dir}/../nvidia/nccl")
endif()
list(APPEND _zs_nccl_hints ${CMAKE_CUDA_COMPILER_TOOLKIT_ROOT} /usr/local/cuda)
find_path(ZS_NCCL_INCLUDE_DIR nccl.h HINTS ${_zs_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
find_library(ZS_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_zs_nccl_hints} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
if(NOT ZS_NCCL_INCLUDE_DIR OR NOT ZS_NCCL_LIBRARY)
  message(FATAL_ERROR "zeroshard: no NCCL found (looked in ${_zs_nccl_hints}); pass -DZS_NCCL_ROOT=<dir with "
                      "include/nccl.h and lib/libnccl.so.2>, or -DZS_WITH_CUDA=OFF")
endif()
file(STRINGS "${ZS_NCCL_INCLUDE_DIR}/nccl.h" _zs_nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
set(_zs_nccl_version "")
foreach(_part MAJOR MINOR PATCH)
  string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _m "${_zs_nccl_defs}")
  list(APPEND _zs_nccl_version ${CMAKE_MATCH_1})
endforeach()
string(JOIN "." _zs_nccl_version ${_zs_nccl_version})
message(STATUS "zeroshard: NCCL ${_zs_nccl_version} (${ZS_NCCL_LIBRARY}), GPU code ${ZS_CUDA_ARCHITECTURES}")

# The kernels: plain CUDA C++, no LibTorch headers (nvcc would spend minutes on them).
add_library(zeroshard_cuda STATIC src/optim/cuda/adamw.cu)
set_target_properties(zeroshard_cuda PROPERTIES
  CUDA_ARCHITECTURES "${ZS_CUDA_ARCHITECTURES}" CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
  CUDA_RUNTIME_LIBRARY Shared POSITION_INDEPENDENT_CODE ON UNITY_BUILD OFF)
target_include_directories(zeroshard_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
# No multiply-add contraction: the device computes the CPU kernel's bits (adamw_math.h).
target_compile_options(zeroshard_cuda PRIVATE -fmad=false -Xcompiler=-Wall,-Wextra,-Wno-unused-parameter)
