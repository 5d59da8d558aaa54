# The CUDA path: the kernels (nvcc) and NCCL, when LibTorch was built with CUDA.
#
# NCCL is the one LibTorch loads (the wheel's nvidia-nccl beside torch), headers
# and library together: a process holds one libnccl.so.2, so the headers we
# compile against must be its version. ZS_NCCL_ROOT overrides (a directory with
# include/nccl.h and lib/libnccl.so*).
#
# Defines: ZS_CUDA_OBJECT (the kernels, which the library carries), zs_dep::nccl,
# ZS_NCCL_INCLUDE_DIR, ZS_NCCL_LIBRARY, ZS_CUDA_INCLUDE_DIRS (NCCL's and the toolkit's headers,
# for the targets of this project that include them).

set(ZS_CUDA_ARCHITECTURES "90-real;90-virtual" CACHE STRING
    "GPU code to build: sm_90 machine code and compute_90 PTX (JIT-compiled for newer GPUs)")
set(ZS_NCCL_ROOT "" CACHE PATH "NCCL to build against (default: the one beside LibTorch, else the CUDA toolkit's)")

# The compiler is the nvcc CMakeLists.txt found (ZS_NVCC, cmake/find_nvcc.cmake), also
# when it is not on PATH. The architectures are ours: CMake's default-architecture probe
# is skipped, and an empty CMAKE_CUDA_ARCHITECTURES left in the cache by a failed
# configure cannot stop this one.
# A project that adds zeroshard and chose its own CUDA compiler keeps it.
if(PROJECT_IS_TOP_LEVEL OR NOT CMAKE_CUDA_COMPILER)
  set(CMAKE_CUDA_COMPILER "${ZS_NVCC}" CACHE FILEPATH "The CUDA compiler (nvcc)" FORCE)
endif()
set(CMAKE_CUDA_ARCHITECTURES ${ZS_CUDA_ARCHITECTURES})
enable_language(CUDA)
set(CMAKE_CUDA_FLAGS "${_zs_user_cuda_flags}")
# Our C++ files that include CUDA headers (LibTorch's ATen/cuda ones among them) take the
# toolkit's, the ones nvcc compiles the kernels with: ZS_CUDA_INCLUDE_DIRS (with NCCL's,
# below), on our own targets alone, whoever builds them (this project, or one that adds it as
# a subdirectory). The runtime they link is the one LibTorch loads (torch::cudart), whose
# wheel carries no headers; a box need not have them in a default include path.

set(_zs_nccl_hints ${ZS_NCCL_ROOT})
list(APPEND _zs_nccl_hints "${ZS_TORCH_LIBRARY_DIR}/../../nvidia/nccl")
list(APPEND _zs_nccl_hints ${CMAKE_CUDA_COMPILER_TOOLKIT_ROOT} /usr/local/cuda)
find_path(ZS_NCCL_INCLUDE_DIR nccl.h HINTS ${_zs_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
if(NOT ZS_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR "zeroshard: no NCCL found (looked in ${_zs_nccl_hints}); pass -DZS_NCCL_ROOT=<dir with "
                      "include/nccl.h and lib/libnccl.so.2>, or -DZS_WITH_CUDA=OFF")
endif()
set(ZS_CUDA_INCLUDE_DIRS ${ZS_NCCL_INCLUDE_DIR} ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
get_filename_component(_zs_nccl_root "${ZS_NCCL_INCLUDE_DIR}" DIRECTORY)
zs_find_nccl(${_zs_nccl_root})  # the library beside the header: zs_dep::nccl
file(STRINGS "${ZS_NCCL_INCLUDE_DIR}/nccl.h" _zs_nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
set(_zs_nccl_version "")
foreach(_part MAJOR MINOR PATCH)
  string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _m "${_zs_nccl_defs}")
  list(APPEND _zs_nccl_version ${CMAKE_MATCH_1})
endforeach()
string(JOIN "." _zs_nccl_version ${_zs_nccl_version})
message(STATUS "zeroshard: NCCL ${_zs_nccl_version} (${ZS_NCCL_LIBRARY}), GPU code ${ZS_CUDA_ARCHITECTURES}")

# The kernels: plain CUDA C++, no LibTorch headers (nvcc would spend minutes on them),
# compiled by a command of ours into an object that libzeroshard.a carries. Not a CMake CUDA
# target: CMake would then record the library as needing the CUDA language at link time, and
# every program linking it (the installed package's too) would have to enable CUDA and would
# link the toolkit's CUDA runtime; the kernels need only the runtime LibTorch loads
# (torch::cudart), which every program linking LibTorch's CUDA build already links.
set(_zs_gencode "")
foreach(_arch IN LISTS ZS_CUDA_ARCHITECTURES)
  string(REGEX MATCH "^[0-9]+" _sm "${_arch}")
  if(NOT _arch MATCHES "-virtual$")
    list(APPEND _zs_gencode "-gencode=arch=compute_${_sm},code=sm_${_sm}")
  endif()
  if(NOT _arch MATCHES "-real$")
    list(APPEND _zs_gencode "-gencode=arch=compute_${_sm},code=compute_${_sm}")
  endif()
endforeach()
separate_arguments(_zs_user_cuda_flag_list UNIX_COMMAND "${_zs_user_cuda_flags}")
set(ZS_CUDA_OBJECT ${PROJECT_BINARY_DIR}/zeroshard_cuda/adamw.cu.o)
file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/zeroshard_cuda)
# No multiply-add contraction: the device computes the CPU kernel's bits (adamw_math.h).
add_custom_command(
  OUTPUT ${ZS_CUDA_OBJECT}
  COMMAND ${ZS_CUDA_LAUNCHER} ${CMAKE_CUDA_COMPILER} ${_zs_gencode} -std=c++17 -O3 -fmad=false ${_zs_user_cuda_flag_list}
          -Xcompiler=-fPIC,-Wall,-Wextra,-Wno-unused-parameter -I${PROJECT_SOURCE_DIR}/src
          -MD -MF ${ZS_CUDA_OBJECT}.d -c ${PROJECT_SOURCE_DIR}/src/optim/cuda/adamw.cu -o ${ZS_CUDA_OBJECT}
  DEPENDS ${PROJECT_SOURCE_DIR}/src/optim/cuda/adamw.cu
  DEPFILE ${ZS_CUDA_OBJECT}.d
  COMMENT "Building CUDA object zeroshard_cuda/adamw.cu.o"
  VERBATIM)
set_source_files_properties(${ZS_CUDA_OBJECT} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
