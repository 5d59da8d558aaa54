# Finds LibTorch (ZS_TORCH):
#   venv    the torch wheel of the project's Python environment (ZS_PYTHON)
#   system  Debian's libtorch-dev 1.13
#   found   whatever find_package(Torch) finds: Torch_DIR, CMAKE_PREFIX_PATH, the system's,
#           or the `torch` target of a project that found LibTorch before adding zeroshard
#   auto    venv when ZS_PYTHON names a Python, else found (the default)
# Sets what find_package(Torch) sets, and what zs_find_torch sets (cmake/zeroshardDependencies.cmake):
# ZS_TORCH_HAS_CUDA (LibTorch was built with CUDA), ZS_TORCH_LIBRARY_DIR, ZS_TORCH_LINK_DIRS.
#
# Supported: 1.13 (Debian's build, the cxx11 ABI) and 2.7 or newer (PyPI's wheels use
# the cxx11 ABI from 2.7; older 2.x wheels cannot link with Debian's C++ libraries).

if(ZS_TORCH STREQUAL "auto")
  if(ZS_PYTHON)
    set(ZS_TORCH venv)
  else()
    set(ZS_TORCH found)
  endif()
endif()
if(ZS_TORCH STREQUAL "venv")
  if(NOT EXISTS "${ZS_PYTHON}")
    message(FATAL_ERROR
      "zeroshard: ZS_TORCH=venv builds against the torch wheel of the project's Python environment, "
      "but ZS_PYTHON ('${ZS_PYTHON}') is not a Python. Run 'make build' (it installs the environment "
      "and passes ZS_PYTHON), or pass -DZS_PYTHON=<env>/bin/python; or build against Debian's "
      "LibTorch with -DZS_TORCH=system (make TORCH=system)")
  endif()
  execute_process(
    COMMAND "${ZS_PYTHON}" -c "import os, torch, torch.utils; print(torch.utils.cmake_prefix_path); print(os.path.dirname(torch.__file__)); print(torch.version.cuda or 'none')"
    OUTPUT_VARIABLE _zs_torch_paths RESULT_VARIABLE _zs_rc ERROR_VARIABLE _zs_err
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _zs_rc EQUAL 0)
    message(FATAL_ERROR "zeroshard: '${ZS_PYTHON}' cannot import torch: ${_zs_err}Run scripts/install-deps.sh")
  endif()
  string(REPLACE "\n" ";" _zs_torch_paths "${_zs_torch_paths}")
  list(GET _zs_torch_paths 0 _zs_cmake_dir)
  list(GET _zs_torch_paths 1 _zs_torch_dir)
  list(GET _zs_torch_paths 2 _zs_torch_cuda_version)
  # The torch directory itself is a prefix too, so that its lib/ is searched before
  # the system's (where Debian's libtorch may also be installed).
  list(PREPEND CMAKE_PREFIX_PATH "${_zs_cmake_dir}" "${_zs_torch_dir}")
  set(Torch_DIR "${_zs_cmake_dir}/Torch" CACHE PATH "The directory of LibTorch's TorchConfig.cmake" FORCE)
  # Left in the cache by LibTorch's Caffe2/public/cuda.cmake in a build tree configured
  # before: the toolkit's libnvrtc, whose directory (holding the toolkit's libcudart too)
  # TorchConfig would put on the programs' RUNPATH ahead of the wheel's.
  unset(CUDA_NVRTC_LIB CACHE)
elseif(ZS_TORCH STREQUAL "system" OR ZS_TORCH STREQUAL "found")
  # Debian's LibTorch: /usr/lib/<triplet>/cmake/Torch, found by default.
  set(_zs_debian_torch "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch")
  if(ZS_TORCH STREQUAL "system")
    if(NOT EXISTS "${_zs_debian_torch}/TorchConfig.cmake")
      message(FATAL_ERROR "zeroshard: ZS_TORCH=system builds against Debian's LibTorch, but there is no "
                          "${_zs_debian_torch}/TorchConfig.cmake; install libtorch-dev (scripts/install-deps.sh)")
    endif()
    set(Torch_DIR "${_zs_debian_torch}" CACHE PATH "The directory of LibTorch's TorchConfig.cmake" FORCE)
  endif()
  if(ZS_BUILD_TESTS AND NOT EXISTS "${ZS_PYTHON}")
    message(STATUS "zeroshard: no project Python environment ('${ZS_PYTHON}'); the tests' Python "
                   "oracles run on /usr/bin/python3 (Debian's h5py and numpy)")
    set(ZS_PYTHON /usr/bin/python3 CACHE FILEPATH "" FORCE)
  endif()
else()
  message(FATAL_ERROR "zeroshard: ZS_TORCH='${ZS_TORCH}' is none of auto, venv, system and found")
endif()

include(${CMAKE_CURRENT_LIST_DIR}/zeroshardDependencies.cmake)
zs_find_torch()
# The linker searches the wheel's nvidia/*/lib for LibTorch's own dependencies: in our
# targets, and in every program that links zeroshard from this build tree.
if(ZS_TORCH_LINK_DIRS)
  string(JOIN ":" _zs_rpath_link ${ZS_TORCH_LINK_DIRS})
  set(ZS_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_zs_rpath_link}")
  add_link_options(${ZS_TORCH_LINK_OPTIONS})
endif()
