# Finds LibTorch: the torch wheel of the project's Python environment (ZS_TORCH=venv)
# or Debian's libtorch-dev 1.13 (ZS_TORCH=system). Sets what find_package(Torch) sets.
#
# Supported: 1.13 (Debian's build, the cxx11 ABI) and 2.7 or newer (PyPI's wheels use
# the cxx11 ABI from 2.7; older 2.x wheels cannot link with Debian's C++ libraries).

if(ZS_TORCH STREQUAL "venv")
  if(NOT EXISTS "${ZS_PYTHON}")
    message(FATAL_ERROR
      "zeroshard: ZS_TORCH=venv builds against the torch wheel of the project's Python environment, "
      "but ZS_PYTHON ('${ZS_PYTHON}') is not a Python. Run 'make build' (it installs the environment "
      "and passes ZS_PYTHON), or pass -DZS_PYTHON=<env>/bin/python; or build against Debian's "
      "LibTorch with -DZS_TORCH=system (make TORCH=system)")
  endif()
  execute_process(
    COMMAND "${ZS_PYTHON}" -c "import os, torch.utils; print(torch.utils.cmake_prefix_path); print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE _zs_torch_paths RESULT_VARIABLE _zs_rc ERROR_VARIABLE _zs_err
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _zs_rc EQUAL 0)
    message(FATAL_ERROR "zeroshard: '${ZS_PYTHON}' cannot import torch: ${_zs_err}Run scripts/install-deps.sh")
  endif()
  string(REPLACE "\n" ";" _zs_torch_paths "${_zs_torch_paths}")
  list(GET _zs_torch_paths 0 _zs_cmake_dir)
  list(GET _zs_torch_paths 1 _zs_torch_dir)
  # The torch directory itself is a prefix too, so that its lib/ is searched before
  # the system's (where Debian's libtorch may also be installed).
  list(PREPEND CMAKE_PREFIX_PATH "${_zs_cmake_dir}" "${_zs_torch_dir}")
  # The wheel's CUDA libraries (NCCL, cuDNN, cuBLAS, ...) are other wheels beside torch.
  # libtorch_cuda finds them at run time through its RPATH; the linker needs them named.
  file(GLOB _zs_nvidia_libs LIST_DIRECTORIES true "${_zs_torch_dir}/../nvidia/*/lib")
  if(_zs_nvidia_libs)
    string(JOIN ":" _zs_rpath_link ${_zs_nvidia_libs})
    add_link_options("LINKER:-rpath-link,${_zs_rpath_link}")
  endif()
elseif(ZS_TORCH STREQUAL "system")
  # Debian's LibTorch: /usr/lib/<triplet>/cmake/Torch, found by default.
  if(NOT EXISTS "${ZS_PYTHON}")
    message(STATUS "zeroshard: no project Python environment ('${ZS_PYTHON}'); the tests' Python "
                   "oracles run on /usr/bin/python3 (Debian's h5py and numpy)")
    set(ZS_PYTHON /usr/bin/python3 CACHE FILEPATH "" FORCE)
  endif()
else()
  message(FATAL_ERROR "zeroshard: ZS_TORCH='${ZS_TORCH}' is neither venv nor system")
endif()

find_package(Torch REQUIRED)
if(Torch_VERSION VERSION_LESS 1.13 OR (Torch_VERSION VERSION_GREATER_EQUAL 2.0 AND Torch_VERSION VERSION_LESS 2.7))
  message(FATAL_ERROR
    "zeroshard: needs LibTorch 2.7 or newer (the cxx11 ABI) or Debian's 1.13; found ${Torch_VERSION} "
    "at ${TORCH_INSTALL_PREFIX}. Install the pinned wheel with scripts/install-deps.sh")
endif()
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(FATAL_ERROR "zeroshard: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} uses the pre-cxx11 ABI, "
                      "which cannot link with Debian's C++ libraries; use torch 2.7 or newer")
endif()
