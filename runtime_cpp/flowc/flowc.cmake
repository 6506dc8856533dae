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

# flowc_model_library(LIBRARY PREFIX BUILD [MULTI_RANK]): set up a compiled model's shared
# library LIBRARY (add_library(LIBRARY SHARED), no sources) and the object library
# LIBRARY_objects that holds its model.cu (add_library(LIBRARY_objects OBJECT model.cu)),
# compiled once, for BUILD. The code is compiled with hidden visibility (inline functions
# too), and LIBRARY exports only the C API: the symbols whose names start with PREFIX
# (model.h marks them FLOWC_API). A linker version script hides the rest, which visibility
# alone does not: the standard library's template instances and what a static library (the
# static CUDA runtime) brings in. MULTI_RANK: a mesh of more than one device
# (flowc_target_comm). A program that shares the runtime's state with the model, such as
# model_main (its streams and counters are the host emulator's), links LIBRARY_objects
# instead of LIBRARY: each shared library has a runtime of its own.
function(flowc_model_library library prefix build)
  cmake_parse_arguments(PARSE_ARGV 3 arg "MULTI_RANK" "" "")
  if(NOT prefix MATCHES "^[A-Za-z_][A-Za-z0-9_]*$")
    message(FATAL_ERROR "flowc_model_library: '${prefix}' is not a C identifier")
  endif()
  set(objects ${library}_objects)
  # The runtime's headers include each other as "flowc/NAME.h": from model.cu's folder.
  get_target_property(sources ${objects} SOURCES)
  list(GET sources 0 source)
  get_filename_component(dir "${source}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  get_filename_component(dir "${dir}" DIRECTORY)
  target_include_directories(${objects} PUBLIC "${dir}")
  set_target_properties(${objects} PROPERTIES POSITION_INDEPENDENT_CODE ON
                        CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden
                        VISIBILITY_INLINES_HIDDEN ON)
  # (CMake gives nvcc the visibility preset, but not the inline functions' flag.)
  target_compile_options(${objects}
                         PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fvisibility-inlines-hidden>)
  flowc_target(${objects} ${build})
  if(arg_MULTI_RANK)
    flowc_target_comm(${objects} ${build})
  endif()
  target_link_libraries(${library} PRIVATE ${objects})
  if(build STREQUAL "cuda")
    set_target_properties(${library} PROPERTIES LINKER_LANGUAGE CUDA)
  else()
    set_target_properties(${library} PROPERTIES LINKER_LANGUAGE CXX)
  endif()
  # Written only when it changes (file(CONFIGURE)), so a reconfigure does not relink.
  set(map "${CMAKE_CURRENT_BINARY_DIR}/${library}.exports")
  file(CONFIGURE OUTPUT "${map}" CONTENT "{\n  global: ${prefix}*;\n  local: *;\n};\n" @ONLY)
  target_link_options(${library} PRIVATE "LINKER:--version-script=${map}")
  set_property(TARGET ${library} APPEND PROPERTY LINK_DEPENDS "${map}")
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
