# What `cmake --install` installs (ZS_INSTALL): the public headers, libzeroshard.a,
# libzeroshard_checkpoint.a and libzeroshard_replica.a, the tools (zeroshard-run, zeroshard-ckpt,
# zeroshard-plan), the CMake package (lib/cmake/zeroshard: find_package(zeroshard 0.2) gives
# zeroshard::zeroshard, zeroshard::checkpoint, zeroshard::replica and the tools as
# zeroshard::zeroshard-run, ...) and zeroshard.pc.
#
# The package finds its dependencies again where the program is built: LibTorch through
# zs_find_torch (cmake/zeroshardDependencies.cmake, installed beside the config), refusing
# another LibTorch release than the one recorded here; nothing of this build tree (src/,
# NCCL's headers, the project's Python environment) is named by an installed file but the
# LibTorch and NCCL this build used, as hints.
include(CMakePackageConfigHelpers)

set(ZS_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/zeroshard" CACHE STRING
    "Where the CMake package goes, relative to the prefix")

install(DIRECTORY include/zeroshard DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development)
install(TARGETS zeroshard zeroshard_checkpoint zeroshard_replica EXPORT zeroshardTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development)
# The launcher and the cost model link no LibTorch; zeroshard-ckpt finds LibTorch (and the
# wheel's CUDA libraries) where this build linked it.
# (CMake adds only the linked directories outside the project on its own, and the project's
# Python environment, with the wheel's LibTorch, may be inside it.)
set(_zs_rpath "${ZS_TORCH_LIBRARY_DIR}")
if(TARGET torch::cudart)
  get_target_property(_zs_cudart torch::cudart INTERFACE_LINK_LIBRARIES)
  foreach(_lib IN LISTS _zs_cudart)
    get_filename_component(_dir "${_lib}" DIRECTORY)
    list(APPEND _zs_rpath "${_dir}")
  endforeach()
endif()
if(ZS_CUDA_ENABLED)
  get_filename_component(_dir "${ZS_NCCL_LIBRARY}" DIRECTORY)
  list(APPEND _zs_rpath "${_dir}")
endif()
list(FILTER _zs_rpath EXCLUDE REGEX "^/usr/lib/?[^/]*$")
set_target_properties(zeroshard-ckpt PROPERTIES INSTALL_RPATH "${_zs_rpath}" INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS zeroshard-run zeroshard-ckpt zeroshard-plan EXPORT zeroshardTargets
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT tools)
install(EXPORT zeroshardTargets NAMESPACE zeroshard:: DESTINATION ${ZS_INSTALL_CMAKEDIR} COMPONENT development)

configure_package_config_file(cmake/zeroshardConfig.cmake.in ${PROJECT_BINARY_DIR}/package/zeroshardConfig.cmake
                              INSTALL_DESTINATION ${ZS_INSTALL_CMAKEDIR})
# 0.y: a minor release may break the API; a patch release does not.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/zeroshardConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/zeroshardConfig.cmake
              ${PROJECT_BINARY_DIR}/package/zeroshardConfigVersion.cmake
              cmake/zeroshardDependencies.cmake
        DESTINATION ${ZS_INSTALL_CMAKEDIR} COMPONENT development)

# zeroshard.pc: what the CMake package carries, as compiler and linker flags, for builds
# without CMake: `pkg-config --cflags --libs zeroshard`. LibTorch has no .pc of its own,
# so its flags are written out from the one this build found.
set(_zs_pc_cflags "-std=c++17")
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  set(_zs_pc_cflags "-std=c++20")  # LibTorch 2.x headers need C++20 (its target asks for cxx_std_20)
endif()
list(APPEND _zs_pc_cflags -fopenmp -pthread)
if(ZS_CUDA_ENABLED)
  list(APPEND _zs_pc_cflags -DZS_WITH_CUDA=1)
endif()
get_target_property(_zs_torch_options torch INTERFACE_COMPILE_OPTIONS)
foreach(_opt IN LISTS _zs_torch_options)
  if(_opt MATCHES "^-D")
    list(APPEND _zs_pc_cflags "${_opt}")
  endif()
endforeach()
foreach(_dir IN LISTS TORCH_INCLUDE_DIRS)
  if(NOT _dir MATCHES "^/usr/include/?$")
    list(APPEND _zs_pc_cflags "-isystem ${_dir}")
  endif()
endforeach()
set(_zs_pc_libs "-L\${libdir}" -lzeroshard_replica -lzeroshard_checkpoint -lzeroshard
    "-L${ZS_TORCH_LIBRARY_DIR}" "-Wl,-rpath,${ZS_TORCH_LIBRARY_DIR}" -Wl,--no-as-needed -ltorch_cpu)
if(ZS_TORCH_HAS_CUDA)
  list(APPEND _zs_pc_libs -ltorch_cuda)
endif()
list(APPEND _zs_pc_libs -Wl,--as-needed -ltorch -lc10)
if(ZS_TORCH_HAS_CUDA)
  list(APPEND _zs_pc_libs -lc10_cuda)
  if(TARGET torch::cudart)
    get_target_property(_zs_cudart torch::cudart INTERFACE_LINK_LIBRARIES)
    list(APPEND _zs_pc_libs ${_zs_cudart})
  endif()
endif()
if(ZS_CUDA_ENABLED)
  list(APPEND _zs_pc_libs "${ZS_NCCL_LIBRARY}")
endif()
if(ZS_TORCH_LINK_DIRS)
  string(JOIN ":" _zs_rpath_link ${ZS_TORCH_LINK_DIRS})
  list(APPEND _zs_pc_libs "-Wl,-rpath-link,${_zs_rpath_link}")
endif()
list(APPEND _zs_pc_libs "${ZS_XXHASH_LIBRARY}" "${ZS_PROTOBUF_LIBRARY}" "${ZS_HDF5_LIBRARY}" "${ZS_CURL_LIBRARY}" "${ZS_PUGIXML_LIBRARY}" "${ZS_CRYPTO_LIBRARY}")
list(APPEND _zs_pc_libs -lspdlog -lfmt -fopenmp -pthread)
# A library named by its path (the wheel's CUDA runtime and NCCL) is found at run time only
# where the program's RPATH says, as CMake's package arranges for its consumers: the same here,
# for each such library outside the loader's default directories.
set(_zs_pc_rpaths "")
foreach(_lib IN LISTS _zs_pc_libs)
  if(IS_ABSOLUTE "${_lib}" AND _lib MATCHES "\\.so(\\.[0-9]+)*$")
    get_filename_component(_dir "${_lib}" DIRECTORY)
    if(NOT _dir MATCHES "^/(usr/)?lib(64)?(/${CMAKE_LIBRARY_ARCHITECTURE})?$" AND NOT _dir IN_LIST _zs_pc_rpaths)
      list(APPEND _zs_pc_rpaths "${_dir}")
    endif()
  endif()
endforeach()
foreach(_dir IN LISTS _zs_pc_rpaths)
  list(APPEND _zs_pc_libs "-Wl,-rpath,${_dir}")
endforeach()
string(JOIN " " ZS_PC_CFLAGS ${_zs_pc_cflags})
string(JOIN " " ZS_PC_LIBS ${_zs_pc_libs})
file(RELATIVE_PATH ZS_PC_PREFIX_FROM_PCFILEDIR "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
configure_file(cmake/zeroshard.pc.in ${PROJECT_BINARY_DIR}/package/zeroshard.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/package/zeroshard.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT development)

# A Debian package (`make deb`: cpack -G DEB in the build against Debian's LibTorch): the
# whole install tree under /usr, depending on the Debian packages a trainer then needs to
# build and run against it. Against PyPI's wheel there is no Debian package to depend on
# (its libraries have no versioned sonames and live in a Python environment): no .deb.
if(PROJECT_IS_TOP_LEVEL)
  set(CPACK_PACKAGE_NAME zeroshard)
  set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "ZeRO/FSDP-style sharded training for LibTorch C++ trainers")
  set(CPACK_PACKAGE_DESCRIPTION "ShardedAdamW (ZeRO-1/2), fully_shard (ZeRO-3), pipelines, sharded HDF5 checkpoints, the zeroshard-run launcher. Headers, static libraries, a CMake package (find_package(zeroshard)) and zeroshard.pc, built against Debian's LibTorch ${Torch_VERSION}.")
  set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_MAINTAINER "zeroshard developers <zeroshard@localhost>")
  set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
  # The LibTorch release it was built against, and no other (its C++ ABI changes with each).
  string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" _zs_torch_minor "${Torch_VERSION}")
  math(EXPR _zs_torch_next "${CMAKE_MATCH_2} + 1")
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "libtorch-dev (>= ${_zs_torch_minor}), libtorch-dev (<< ${CMAKE_MATCH_1}.${_zs_torch_next}~), libspdlog-dev, libhdf5-dev, libxxhash-dev, libprotobuf-dev, libcurl4-openssl-dev, libpugixml-dev, ca-certificates, g++")
  if(ZS_TORCH STREQUAL "system")
    set(CPACK_GENERATOR DEB)
  else()
    set(CPACK_GENERATOR TGZ)
  endif()
  include(CPack)
endif()
