# Finds what zeroshard links, for its own build (CMakeLists.txt, cmake/torch.cmake) and for a
# program that links the installed package (zeroshardConfig.cmake), the same way.
#
# zs_find_torch(<first hint> [<more hints>...])
#   A macro (find_package's variables land in the caller's scope). Without a `torch` target
#   already defined, it looks for TorchConfig.cmake where find_package(Torch) would
#   (Torch_DIR, CMAKE_PREFIX_PATH, the system prefixes), then in the hint directories, and
#   finds Torch there. A torch target already defined (the program found Torch itself) is
#   used as it is. For a CUDA build of PyPI's torch wheel it first defines torch::cudart as
#   the wheel's CUDA runtime, the one libtorch_cuda loads: a program then holds one
#   libcudart, and LibTorch's Caffe2/public/cuda.cmake (guarded by that target) neither
#   requires a CUDA toolkit to configure nor rewrites the program's CUDA settings.
#   Sets:
#     ZS_TORCH_HAS_CUDA      LibTorch was built with CUDA
#     ZS_TORCH_LIBRARY_DIR   the directory of libtorch_cpu
#     ZS_TORCH_LINK_DIRS     directories the linker must search for LibTorch's own
#                            dependencies (the wheel's nvidia/*/lib: NCCL, cuBLAS, ...)
#
# zs_check_torch_version(<version> <where>)
#   Fails unless the LibTorch found has <version>'s major.minor: LibTorch's C++ ABI changes
#   with every release, so a library built against one cannot link another.
#
# zs_find_nccl(<hints>...)
#   Defines zs_dep::nccl, the first libnccl.so.2 under the hints (their lib/ or lib64/).
#   Sets ZS_NCCL_LIBRARY.
#
# zs_find_hdf5(<hints>...)
#   Defines zs_dep::hdf5, HDF5's C library (a shared library carries its own dependencies).
#   CMake's FindHDF5 needs the C language enabled, which a C++ program need not have.
#
# zs_find_xxhash()
#   Defines zs_dep::xxhash (libxxhash; Debian's libxxhash-dev has no CMake package).
#   Sets ZS_XXHASH_INCLUDE_DIR.
#
# zs_find_protobuf()
#   Defines zs_dep::protobuf (libprotobuf, the one Debian's LibTorch 1.13 loads too: TensorBoard's
#   event files are protobuf messages; Debian's libprotobuf-dev). Sets ZS_PROTOBUF_INCLUDE_DIR.
#
# zs_find_object_store_deps()
#   Defines zs_dep::curl (libcurl: the durable tier's HTTP and SigV4), zs_dep::pugixml
#   (the S3 API's XML answers) and zs_dep::crypto (OpenSSL's libcrypto: uploads' Content-MD5).
#   Sets ZS_CURL_LIBRARY, ZS_PUGIXML_LIBRARY, ZS_CRYPTO_LIBRARY.

macro(zs_find_torch)
  if(NOT TARGET torch)
    set(_zs_torch_hints ${ARGN})
    find_file(_zs_torch_config NAMES TorchConfig.cmake torch-config.cmake NO_CACHE
              HINTS ${Torch_DIR} $ENV{Torch_DIR} ${CMAKE_PREFIX_PATH} $ENV{CMAKE_PREFIX_PATH} ${CMAKE_SYSTEM_PREFIX_PATH}
              PATHS ${_zs_torch_hints}
              PATH_SUFFIXES Torch share/cmake/Torch lib/cmake/Torch lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch
              NO_DEFAULT_PATH)
    if(NOT _zs_torch_config)
      message(FATAL_ERROR
        "zeroshard: no LibTorch found (no TorchConfig.cmake under Torch_DIR, CMAKE_PREFIX_PATH, the system "
        "prefixes or ${_zs_torch_hints}). Pass -DCMAKE_PREFIX_PATH=<LibTorch> (for PyPI's torch: "
        "python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)'), or install libtorch-dev")
    endif()
    get_filename_component(_zs_torch_cmake_dir "${_zs_torch_config}" DIRECTORY)
    # A wheel: torch/share/cmake/Torch, with torch/lib and the nvidia-* wheels beside torch.
    get_filename_component(_zs_torch_root "${_zs_torch_cmake_dir}/../../.." ABSOLUTE)
    if(EXISTS "${_zs_torch_root}/lib/libtorch_cuda.so" AND NOT TARGET torch::cudart)
      file(GLOB _zs_cudart "${_zs_torch_root}/../nvidia/*/lib/libcudart.so.[0-9]*")
      set(_zs_caffe2_cuda "${_zs_torch_cmake_dir}/../Caffe2/public/cuda.cmake")
      list(LENGTH _zs_cudart _zs_n)
      if(_zs_n GREATER 1)
        message(FATAL_ERROR
          "zeroshard: the torch wheel at ${_zs_torch_root} is a CUDA build, but its nvidia/*/lib directories "
          "hold ${_zs_n} CUDA runtimes ('${_zs_cudart}') where one libcudart.so.N was expected. Reinstall "
          "the wheels (scripts/install-deps.sh installs the pinned ones, scripts/requirements.txt)")
      endif()
      if(_zs_n EQUAL 1 AND EXISTS "${_zs_caffe2_cuda}")
        file(STRINGS "${_zs_caffe2_cuda}" _zs_guard REGEX "^if\\(TARGET torch::cudart\\)")
        if(NOT _zs_guard)
          message(FATAL_ERROR
            "zeroshard: ${_zs_caffe2_cuda} has no 'if(TARGET torch::cudart)' include guard, which zeroshard "
            "relies on to configure this CUDA wheel without a CUDA toolkit. Use torch 2.7 or newer "
            "(scripts/requirements.txt pins the tested one)")
        endif()
        add_library(torch::cudart INTERFACE IMPORTED)
        set_property(TARGET torch::cudart PROPERTY INTERFACE_LINK_LIBRARIES "${_zs_cudart}")
      endif()
    endif()
    set(Torch_DIR "${_zs_torch_cmake_dir}" CACHE PATH "The directory of LibTorch's TorchConfig.cmake" FORCE)
    find_package(Torch CONFIG REQUIRED)
  endif()
  if(NOT DEFINED Torch_VERSION OR NOT DEFINED TORCH_INSTALL_PREFIX)
    message(FATAL_ERROR "zeroshard: a 'torch' target is defined, but not by LibTorch's TorchConfig.cmake "
                        "(Torch_VERSION and TORCH_INSTALL_PREFIX are not set); find LibTorch with find_package(Torch)")
  endif()
  # The library directory: libtorch_cpu's (Debian's is /usr/lib/<triplet>, the wheel's torch/lib).
  find_library(_zs_torch_cpu torch_cpu NO_CACHE HINTS "${TORCH_INSTALL_PREFIX}/lib"
               "${TORCH_INSTALL_PREFIX}/lib/${CMAKE_LIBRARY_ARCHITECTURE}" NO_DEFAULT_PATH)
  if(NOT _zs_torch_cpu)
    find_library(_zs_torch_cpu torch_cpu NO_CACHE)
  endif()
  get_filename_component(ZS_TORCH_LIBRARY_DIR "${_zs_torch_cpu}" DIRECTORY)
  if(EXISTS "${ZS_TORCH_LIBRARY_DIR}/libtorch_cuda.so" OR TORCH_CUDA_LIBRARIES)
    set(ZS_TORCH_HAS_CUDA ON)
  else()
    set(ZS_TORCH_HAS_CUDA OFF)
  endif()
  # The wheel's CUDA libraries (NCCL, cuDNN, cuBLAS, ...) are other wheels beside torch.
  # libtorch_cuda finds them at run time through its RPATH; the linker needs them named.
  file(GLOB ZS_TORCH_LINK_DIRS LIST_DIRECTORIES true "${ZS_TORCH_LIBRARY_DIR}/../../nvidia/*/lib")
  if(Torch_VERSION VERSION_LESS 1.13 OR (Torch_VERSION VERSION_GREATER_EQUAL 2.0 AND Torch_VERSION VERSION_LESS 2.7))
    message(FATAL_ERROR
      "zeroshard: needs LibTorch 2.7 or newer (the cxx11 ABI) or Debian's 1.13; found ${Torch_VERSION} "
      "at ${TORCH_INSTALL_PREFIX}. Install the pinned wheel with scripts/install-deps.sh")
  endif()
  if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
    message(FATAL_ERROR "zeroshard: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} uses the pre-cxx11 ABI, "
                        "which cannot link with Debian's C++ libraries; use torch 2.7 or newer")
  endif()
endmacro()

function(zs_check_torch_version built_version built_where)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _built "${built_version}")
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _found "${Torch_VERSION}")
  if(NOT _built STREQUAL _found)
    message(FATAL_ERROR
      "zeroshard: this zeroshard was built against LibTorch ${built_version} (${built_where}), but this project "
      "found LibTorch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX}); LibTorch's C++ ABI differs between releases. "
      "Point CMAKE_PREFIX_PATH (or Torch_DIR) at LibTorch ${_built}, or build zeroshard against ${_found}")
  endif()
endfunction()

# The imported target `target` for the library file `library` (found by the caller), or a
# failure naming `what` was missing and `fix`.
function(_zs_import_library target library what fix)
  if(NOT library)
    message(FATAL_ERROR "zeroshard: no ${what} found; ${fix}")
  endif()
  if(NOT TARGET ${target})
    add_library(${target} UNKNOWN IMPORTED)
    set_property(TARGET ${target} PROPERTY IMPORTED_LOCATION "${library}")
  endif()
endfunction()

function(zs_find_nccl)
  find_library(ZS_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${ARGN}
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
  _zs_import_library(zs_dep::nccl "${ZS_NCCL_LIBRARY}" "NCCL (looked in ${ARGN})"
                     "pass -DZS_NCCL_ROOT=<dir with include/nccl.h and lib/libnccl.so.2>, or -DZS_WITH_CUDA=OFF")
endfunction()

# A library found with its header: `target` (include directory in `prefix`_INCLUDE_DIR, the
# library in `prefix`_LIBRARY), or a fatal error naming `what` and `fix`.
function(_zs_find_with_header target prefix header library what fix)
  find_path(${prefix}_INCLUDE_DIR ${header})
  find_library(${prefix}_LIBRARY ${library})
  set(_found "${${prefix}_LIBRARY}")
  if(NOT ${prefix}_INCLUDE_DIR)
    set(_found "")  # the header is needed too
  endif()
  _zs_import_library(${target} "${_found}" "${what}" "${fix}")
  set_property(TARGET ${target} PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${${prefix}_INCLUDE_DIR}")
endfunction()

function(zs_find_xxhash)
  _zs_find_with_header(zs_dep::xxhash ZS_XXHASH xxhash.h xxhash "xxHash (xxhash.h and libxxhash)"
                       "install libxxhash-dev (scripts/install-deps.sh)")
endfunction()

# The headers beside the library found (LibTorch's wheel carries protobuf headers of its own, of
# whatever version it bundles: those would not match the library).
function(zs_find_protobuf)
  find_library(ZS_PROTOBUF_LIBRARY protobuf)
  get_filename_component(_libdir "${ZS_PROTOBUF_LIBRARY}" DIRECTORY)
  find_path(ZS_PROTOBUF_INCLUDE_DIR google/protobuf/wire_format_lite.h
            HINTS "${_libdir}/../../include" "${_libdir}/../include" NO_DEFAULT_PATH)
  _zs_find_with_header(zs_dep::protobuf ZS_PROTOBUF google/protobuf/wire_format_lite.h protobuf
                       "protobuf (google/protobuf and libprotobuf)" "install libprotobuf-dev (scripts/install-deps.sh)")
endfunction()

function(zs_find_hdf5)
  find_library(ZS_HDF5_LIBRARY NAMES hdf5_serial hdf5 NAMES_PER_DIR HINTS ${ARGN} PATH_SUFFIXES hdf5/serial)
  _zs_import_library(zs_dep::hdf5 "${ZS_HDF5_LIBRARY}" "HDF5 C library (looked in ${ARGN} and the system's)"
                     "install libhdf5-dev (scripts/install-deps.sh)")
endfunction()

# A system library found by its header and its name, imported as `target` (cache variables
# ZS_<var>_INCLUDE_DIR, ZS_<var>_LIBRARY); a missing one stops the configure naming `package`.
function(_zs_find_system_library target var header name what package)
  find_path(ZS_${var}_INCLUDE_DIR ${header})
  find_library(ZS_${var}_LIBRARY ${name})
  set(_zs_library "${ZS_${var}_LIBRARY}")
  if(NOT ZS_${var}_INCLUDE_DIR)
    set(_zs_library "")
  endif()
  _zs_import_library(${target} "${_zs_library}" "${what} (${header} and lib${name})"
                     "install ${package} (scripts/install-deps.sh)")
endfunction()

function(zs_find_object_store_deps)
  _zs_find_system_library(zs_dep::curl CURL curl/curl.h curl "libcurl" libcurl4-openssl-dev)
  _zs_find_system_library(zs_dep::pugixml PUGIXML pugixml.hpp pugixml "pugixml" libpugixml-dev)
  _zs_find_system_library(zs_dep::crypto CRYPTO openssl/evp.h crypto "OpenSSL's libcrypto" libssl-dev)
endfunction()
