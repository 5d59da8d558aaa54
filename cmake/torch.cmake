# Finds LibTorch: the torch wheel of the project's Python environment (ZS_TORCH=venv)
# or Debian's libtorch-dev 1.13 (ZS_TORCH=system). Sets what find_package(Torch) sets, and
# ZS_TORCH_HAS_CUDA (LibTorch was built with CUDA).
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
  # The wheel's CUDA libraries (NCCL, cuDNN, cuBLAS, ...) are other wheels beside torch.
  # libtorch_cuda finds them at run time through its RPATH; the linker needs them named.
  file(GLOB _zs_nvidia_libs LIST_DIRECTORIES true "${_zs_torch_dir}/../nvidia/*/lib")
  if(_zs_nvidia_libs)
    string(JOIN ":" _zs_rpath_link ${_zs_nvidia_libs})
    add_link_options("LINKER:-rpath-link,${_zs_rpath_link}")
  endif()
  if(NOT _zs_torch_cuda_version STREQUAL "none")
    set(ZS_TORCH_HAS_CUDA ON)
    # The CUDA runtime is the wheel's (nvidia-cuda-runtime beside torch), the one
    # libtorch_cuda loads: one libcudart in the process, whatever toolkit compiles
    # our kernels. Defined before find_package(Torch), torch::cudart is also the
    # include guard of LibTorch's Caffe2/public/cuda.cmake, which would otherwise
    # require a CUDA toolkit (FindCUDA, enable_language(CUDA)) to configure at all
    # and link the toolkit's libcudart. Whether our GPU path is built is decided
    # later, by whether nvcc is found (cmake/find_nvcc.cmake).
    file(GLOB _zs_cudart "${_zs_torch_dir}/../nvidia/*/lib/libcudart.so.[0-9]*")
    set(_zs_caffe2_cuda "${_zs_cmake_dir}/Caffe2/public/cuda.cmake")
    file(STRINGS "${_zs_caffe2_cuda}" _zs_guard REGEX "^if\\(TARGET torch::cudart\\)")
    list(LENGTH _zs_cudart _zs_n)
    if(NOT _zs_n EQUAL 1)
      message(FATAL_ERROR
        "zeroshard: the torch wheel at ${_zs_torch_dir} is a CUDA ${_zs_torch_cuda_version} build, but "
        "its nvidia/*/lib directories hold ${_zs_n} CUDA runtimes ('${_zs_cudart}') where one libcudart.so.N "
        "was expected. Reinstall the pinned wheels with scripts/install-deps.sh (scripts/requirements.txt)")
    endif()
    if(NOT _zs_guard)
      message(FATAL_ERROR
        "zeroshard: ${_zs_caffe2_cuda} has no 'if(TARGET torch::cudart)' include guard, which "
        "cmake/torch.cmake relies on to configure this CUDA wheel without a CUDA toolkit. Use the pinned "
        "torch (scripts/requirements.txt), or adapt cmake/torch.cmake to this wheel's CMake config")
    endif()
    add_library(torch::cudart INTERFACE IMPORTED)
    set_property(TARGET torch::cudart PROPERTY INTERFACE_LINK_LIBRARIES "${_zs_cudart}")
    # Left in the cache by that file in a build tree configured before: the toolkit's
    # libnvrtc, whose directory (holding the toolkit's libcudart too) TorchConfig would
    # put on the programs' RUNPATH ahead of the wheel's.
    unset(CUDA_NVRTC_LIB CACHE)
  else()
    set(ZS_TORCH_HAS_CUDA OFF)
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
if(ZS_TORCH STREQUAL "system")
  if(TORCH_CUDA_LIBRARIES)
    set(ZS_TORCH_HAS_CUDA ON)
  else()
    set(ZS_TORCH_HAS_CUDA OFF)
  endif()
endif()
if(Torch_VERSION VERSION_LESS 1.13 OR (Torch_VERSION VERSION_GREATER_EQUAL 2.0 AND Torch_VERSION VERSION_LESS 2.7))
  message(FATAL_ERROR
    "zeroshard: needs LibTorch 2.7 or newer (the cxx11 ABI) or Debian's 1.13; found ${Torch_VERSION} "
    "at ${TORCH_INSTALL_PREFIX}. Install the pinned wheel with scripts/install-deps.sh")
endif()
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(FATAL_ERROR "zeroshard: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} uses the pre-cxx11 ABI, "
                      "which cannot link with Debian's C++ libraries; use torch 2.7 or newer")
endif()
