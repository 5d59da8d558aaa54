# Finds nvcc, the compiler of our CUDA kernels (src/optim/cuda), without relying on
# PATH: a CUDA toolkit at /usr/local/cuda whose bin/ is not on PATH is the usual install.
#
# zs_find_nvcc(<path-var> <version-var> <where-var> <searched-var>) tries, in order:
#   CMAKE_CUDA_COMPILER (a -D, or the cache of an earlier configure), the CUDACXX
#   environment variable, <CUDAToolkit_ROOT>/bin (CMake variable or environment),
#   $CUDA_HOME/bin and $CUDA_PATH/bin, nvcc on PATH, /usr/local/cuda/bin/nvcc;
# and returns the first one that runs (`nvcc --version`), so that a cache entry left by
# a toolkit that has since gone, or a wrapper script whose toolkit is missing, is passed
# over rather than failing the configure. <path-var> gets its path ("" when none runs),
# <version-var> its release ("13.0"), <where-var> which of the above named it, and
# <searched-var> what was looked at, for the message that explains a CPU-only build.

function(zs_find_nvcc path_var version_var where_var searched_var)
  set(labels "")
  set(paths "")
  macro(_zs_nvcc_candidate label path)
    list(APPEND labels "${label}")
    list(APPEND paths "${path}")
  endmacro()
  if(CMAKE_CUDA_COMPILER)
    _zs_nvcc_candidate("CMAKE_CUDA_COMPILER" "${CMAKE_CUDA_COMPILER}")
  endif()
  if(DEFINED ENV{CUDACXX} AND NOT "$ENV{CUDACXX}" STREQUAL "")
    _zs_nvcc_candidate("CUDACXX" "$ENV{CUDACXX}")
  endif()
  if(CUDAToolkit_ROOT)
    _zs_nvcc_candidate("CUDAToolkit_ROOT" "${CUDAToolkit_ROOT}/bin/nvcc")
  endif()
  foreach(env CUDAToolkit_ROOT CUDA_HOME CUDA_PATH)
    if(DEFINED ENV{${env}} AND NOT "$ENV{${env}}" STREQUAL "")
      _zs_nvcc_candidate("\$${env}" "$ENV{${env}}/bin/nvcc")
    endif()
  endforeach()
  set(path_dirs "$ENV{PATH}")
  string(REPLACE ":" ";" path_dirs "${path_dirs}")
  foreach(dir IN LISTS path_dirs)
    if(dir AND EXISTS "${dir}/nvcc" AND NOT IS_DIRECTORY "${dir}/nvcc")
      _zs_nvcc_candidate("PATH" "${dir}/nvcc")
    endif()
  endforeach()
  _zs_nvcc_candidate("/usr/local/cuda/bin" "/usr/local/cuda/bin/nvcc")

  set(broken "")
  list(LENGTH paths n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    list(GET paths ${i} nvcc)
    list(GET labels ${i} label)
    if(NOT EXISTS "${nvcc}" OR IS_DIRECTORY "${nvcc}")
      continue()
    endif()
    execute_process(COMMAND "${nvcc}" --version OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
    if(rc EQUAL 0 AND out MATCHES "release ([0-9]+\\.[0-9]+)")
      set(${path_var} "${nvcc}" PARENT_SCOPE)
      set(${version_var} "${CMAKE_MATCH_1}" PARENT_SCOPE)
      set(${where_var} "${label}" PARENT_SCOPE)
      return()
    endif()
    list(APPEND broken "${nvcc} (from ${label}) does not run: 'nvcc --version' exited with ${rc}")
  endforeach()

  set(${path_var} "" PARENT_SCOPE)
  set(${version_var} "" PARENT_SCOPE)
  set(${where_var} "" PARENT_SCOPE)
  set(searched "no nvcc on PATH or in /usr/local/cuda/bin")
  list(REMOVE_ITEM labels "PATH" "/usr/local/cuda/bin")
  if(labels)
    string(JOIN ", " named ${labels})
    string(APPEND searched ", nor where ${named} say")
  endif()
  if(broken)
    string(JOIN "; " broken ${broken})
    string(APPEND searched "; ${broken}")
  endif()
  set(${searched_var} "${searched}" PARENT_SCOPE)
endfunction()
