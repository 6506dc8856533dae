# FLOWC_SANITIZE: sanitizers for the host build, "address", "undefined" or
# "address,undefined" (empty: none). flowc builds such a program in its own build directory
# (build-host-asan, ...), so sanitized and plain objects never mix.
set(FLOWC_SANITIZE "" CACHE STRING "host build only: address, undefined or address,undefined")

# flowc_target(TARGET BUILD): compile TARGET's .cu sources for BUILD (cuda or host) and link
# what flowc's runtime needs. Every difference between the two builds lives here and in the
# runtime headers; generated CMakeLists only call this.
function(flowc_target target build)
  get_target_property(sources ${target} SOURCES)
  if(NOT FLOWC_SANITIZE STREQUAL "")
    if(NOT build STREQUAL "host")
      message(FATAL_ERROR "FLOWC_SANITIZE is for the host build only (FLOWC_TARGET=host)")
    endif()
    if(NOT FLOWC_SANITIZE MATCHES "^(address|undefined)(,(address|undefined))?$")
      message(FATAL_ERROR "FLOWC_SANITIZE must be address, undefined or address,undefined, "
                          "not '${FLOWC_SANITIZE}'")
    endif()
    # Reports are fatal (a test sees a failed run, not a line in a log). -O1 after the build
    # type's flags (the last -O wins): what ASan recommends, and quick to compile; frame
    # pointers give ASan's fast unwinder whole stacks.
    target_compile_options(${target} PRIVATE -fsanitize=${FLOWC_SANITIZE} -fno-sanitize-recover=all
                                             -fno-omit-frame-pointer -O1 -g1)
    target_link_options(${target} PUBLIC -fsanitize=${FLOWC_SANITIZE})
  endif()
  if(build STREQUAL "host")
    # g++ reads .cu as a linker script unless told the language.
    set_source_files_properties(${sources} PROPERTIES LANGUAGE CXX)
    target_compile_options(${target} PRIVATE -x c++ -Wall -Wextra)
    target_compile_definitions(${target} PUBLIC FLOWC_HOST)
    find_package(OpenMP REQUIRED)
    find_library(FLOWC_BOOST_CONTEXT boost_context REQUIRED)
    find_library(FLOWC_OPENBLAS openblas REQUIRED)
    target_link_libraries(${target} PUBLIC OpenMP::OpenMP_CXX ${FLOWC_BOOST_CONTEXT} ${FLOWC_OPENBLAS})
  elseif(build STREQUAL "cuda")
    set_source_files_properties(${sources} PROPERTIES LANGUAGE CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_library(FLOWC_CUDNN NAMES cudnn libcudnn.so.9
                 HINTS ${FLOWC_CUDA_LIB_DIRS} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64 REQUIRED)
    find_library(FLOWC_CUBLASLT NAMES cublasLt libcublasLt.so.13
                 HINTS ${FLOWC_CUDA_LIB_DIRS} ${CUDAToolkit_LIBRARY_DIR} REQUIRED)
    target_include_directories(${target} PUBLIC ${FLOWC_CUDA_INCLUDE_DIRS})
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>)
    target_link_libraries(${target} PUBLIC CUDA::cudart ${FLOWC_CUBLASLT} ${FLOWC_CUDNN})
  else()
    message(FATAL_ERROR "FLOWC_TARGET must be cuda or host, not '${build}'")
  endif()
endfunction()

# flowc_target_comm(TARGET BUILD): for programs whose mesh has more than one device. Links MPI
# (which starts the ranks in both builds) and, for BUILD cuda, NCCL; defines FLOWC_MULTI_RANK,
# which flowc/comm.h requires. Call it beside flowc_target().
function(flowc_target_comm target build)
  # Only MPI's C API is used: skip the deprecated C++ bindings (libmpi_cxx).
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI REQUIRED COMPONENTS CXX)
  # Threads: FLOWC_TIMEOUT_S's StopWatch runs on a thread of its own.
  find_package(Threads REQUIRED)
  target_link_libraries(${target} PUBLIC MPI::MPI_CXX Threads::Threads)
  target_compile_definitions(${target} PUBLIC FLOWC_MULTI_RANK)
  if(build STREQUAL "cuda")
    find_package(CUDAToolkit REQUIRED)
    # NCCL comes with a system CUDA or as the nvidia-nccl-cu13 wheel (libnccl.so.2 only).
    find_library(FLOWC_NCCL NAMES nccl libnccl.so.2
                 HINTS ${FLOWC_CUDA_LIB_DIRS} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64 REQUIRED)
    find_path(FLOWC_NCCL_INCLUDE nccl.h
              HINTS ${FLOWC_CUDA_INCLUDE_DIRS} ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include REQUIRED)
    target_include_directories(${target} PUBLIC ${FLOWC_NCCL_INCLUDE})
    target_link_libraries(${target} PUBLIC ${FLOWC_NCCL})
  elseif(NOT build STREQUAL "host")
    message(FATAL_ERROR "FLOWC_TARGET must be cuda or host, not '${build}'")
  endif()
endfunction()
