# flowc_target(TARGET BUILD): compile TARGET's .cu sources for BUILD (cuda or host) and link
# what flowc's runtime needs. Every difference between the two builds lives here and in the
# runtime headers; generated CMakeLists only call this.
function(flowc_target target build)
  get_target_property(sources ${target} SOURCES)
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
