# flowc's CMake package. find_package(flowc CONFIG REQUIRED) defines
#
#   flowc_add_model(<name> MODEL <file> [TARGET host|cuda] [PRECISION fp32|tf32|bf16|fp16]
#                   [MESH N|AxB] [PREFIX <p>] [ARCH <NN>] [WEIGHTS <file>]
#                   [DEPENDS <file>...] [OPTIONS <flowc compile option>...] [NO_INSTALL])
#
# which runs `flowc compile` on the model at build time (again whenever the model, or a file
# it depends on, changes) and builds the shared library <name> with the model's C API
# (<p>_create, <p>_run, ...; <p> is <name> unless PREFIX says): consumers link it and
# #include "<name>/model.h". docs/cmake.md describes it all.
#
# flowc's wheel installs this folder as <prefix>/share/cmake/flowc, beside <prefix>/bin/flowc:
# the flowc it calls, by its absolute path (no PATH needed); -DFLOWC_EXECUTABLE=... picks
# another. `flowc --cmake-dir` prints this folder, the value for flowc_DIR.

if(CMAKE_VERSION VERSION_LESS 3.20)
  set(flowc_FOUND FALSE)
  set(flowc_NOT_FOUND_MESSAGE "flowc's CMake package needs CMake 3.20 or newer, not ${CMAKE_VERSION}")
  return()
endif()

# The flowc command: FLOWC_EXECUTABLE when given, else the one installed with this package.
if(NOT FLOWC_EXECUTABLE)
  get_filename_component(_flowc_here "${CMAKE_CURRENT_LIST_DIR}" ABSOLUTE)
  get_filename_component(_flowc_real "${CMAKE_CURRENT_LIST_DIR}" REALPATH)
  foreach(_flowc_dir IN ITEMS "${_flowc_here}" "${_flowc_real}")
    foreach(_flowc_exe IN ITEMS "${_flowc_dir}/../../../bin/flowc" "${_flowc_dir}/../../../Scripts/flowc.exe")
      if(EXISTS "${_flowc_exe}" AND NOT IS_DIRECTORY "${_flowc_exe}")
        get_filename_component(FLOWC_EXECUTABLE "${_flowc_exe}" ABSOLUTE)
        break()
      endif()
    endforeach()
    if(FLOWC_EXECUTABLE)
      break()
    endif()
  endforeach()
  unset(_flowc_here)
  unset(_flowc_real)
  unset(_flowc_dir)
  unset(_flowc_exe)
endif()
if(NOT FLOWC_EXECUTABLE OR NOT EXISTS "${FLOWC_EXECUTABLE}")
  set(flowc_FOUND FALSE)
  get_filename_component(_flowc_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  set(flowc_NOT_FOUND_MESSAGE
      "flowc's CMake package in ${CMAKE_CURRENT_LIST_DIR} finds no flowc command beside it "
      "(${_flowc_prefix}/bin/flowc): reinstall flowc, give the folder that `flowc --cmake-dir` "
      "prints as flowc_DIR, or name the command with -DFLOWC_EXECUTABLE=/path/to/flowc")
  unset(_flowc_prefix)
  return()
endif()
set_property(GLOBAL PROPERTY FLOWC_EXECUTABLE "${FLOWC_EXECUTABLE}")
if(NOT TARGET flowc::flowc)
  add_executable(flowc::flowc IMPORTED)
  set_target_properties(flowc::flowc PROPERTIES IMPORTED_LOCATION "${FLOWC_EXECUTABLE}")
endif()

# The runtime's CMake functions (flowc_target, flowc_model_library, ...): the copy installed
# with this package, or in a source checkout the runtime's own file.
if(EXISTS "${CMAKE_CURRENT_LIST_DIR}/flowc-runtime.cmake")
  include("${CMAKE_CURRENT_LIST_DIR}/flowc-runtime.cmake")
else()
  include("${CMAKE_CURRENT_LIST_DIR}/../../runtime_cpp/flowc/flowc.cmake")
endif()

# The defaults of flowc_add_model's TARGET and ARCH, and where the CUDA build finds cuBLASLt
# and cuDNN (NCCL for a mesh) when CMake does not (as in a project `flowc compile` writes).
set(FLOWC_TARGET "host" CACHE STRING "flowc_add_model's default TARGET: host or cuda")
set(FLOWC_CUDA_ARCH "90" CACHE STRING "flowc_add_model's default ARCH (90 = sm_90)")
set(FLOWC_CUDA_LIB_DIRS "" CACHE STRING "extra directories with cuBLASLt/cuDNN (e.g. NVIDIA's wheels)")
set(FLOWC_CUDA_INCLUDE_DIRS "" CACHE STRING "extra include directories (cuDNN headers from wheels)")

# flowc_add_model() is a macro so that it can enable the languages the model's code needs
# (enable_language must be called at the top of a directory, not in a function): C++, and
# CUDA the first time a model's TARGET is cuda. A project(app CXX), or project(app C) for a
# C program, needs nothing else. The work is _flowc_add_model's.
macro(flowc_add_model)
  _flowc_model_build(_flowc_build ${ARGV})
  get_property(_flowc_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
  if(NOT "CXX" IN_LIST _flowc_languages)
    enable_language(CXX)
  endif()
  if(_flowc_build STREQUAL "cuda" AND NOT "CUDA" IN_LIST _flowc_languages)
    enable_language(CUDA)
  endif()
  unset(_flowc_languages)
  unset(_flowc_build)
  _flowc_add_model(${ARGV})
endmacro()

# The build (host or cuda) that flowc_add_model(ARGS) asks for.
function(_flowc_model_build var)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_INSTALL"
                        "NAME;MODEL;TARGET;PRECISION;MESH;PREFIX;ARCH;WEIGHTS" "DEPENDS;OPTIONS")
  if(arg_TARGET)
    set(${var} "${arg_TARGET}" PARENT_SCOPE)
  elseif(FLOWC_TARGET)
    set(${var} "${FLOWC_TARGET}" PARENT_SCOPE)
  else()
    set(${var} "host" PARENT_SCOPE)
  endif()
endfunction()

function(_flowc_add_model)
  cmake_parse_arguments(PARSE_ARGV 0 arg "NO_INSTALL"
                        "NAME;MODEL;TARGET;PRECISION;MESH;PREFIX;ARCH;WEIGHTS" "DEPENDS;OPTIONS")
  # The name: flowc_add_model(<name> ...) or flowc_add_model(NAME <name> ...).
  set(extra ${arg_UNPARSED_ARGUMENTS})
  set(name "${arg_NAME}")
  if(name STREQUAL "" AND extra)
    list(POP_FRONT extra name)
  endif()
  set(where "flowc_add_model(${name})")
  if(name STREQUAL "")
    message(FATAL_ERROR "flowc_add_model: no name; call it as flowc_add_model(<name> MODEL <file> ...)")
  endif()
  if(extra)
    message(FATAL_ERROR "${where}: unexpected arguments: ${extra}")
  endif()
  if(arg_KEYWORDS_MISSING_VALUES)
    message(FATAL_ERROR "${where}: no value after ${arg_KEYWORDS_MISSING_VALUES}")
  endif()
  if(NOT name MATCHES "^[A-Za-z0-9_.+-]+$")
    message(FATAL_ERROR "${where}: the name names a target and a folder: letters, digits and _ . + - only")
  endif()
  if(TARGET "${name}" OR TARGET "${name}_objects")
    message(FATAL_ERROR "${where}: a target named ${name} or ${name}_objects exists already")
  endif()

  # The model, and what else it is made from.
  if(NOT arg_MODEL)
    message(FATAL_ERROR "${where}: MODEL <file> is missing (an .onnx or .flow file)")
  endif()
  get_filename_component(model "${arg_MODEL}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT EXISTS "${model}" OR IS_DIRECTORY "${model}")
    message(FATAL_ERROR "${where}: MODEL ${arg_MODEL}: no such file (${model})")
  endif()
  set(depends "${model}")
  # An ONNX model's external data, where exporters put it (others: DEPENDS).
  get_filename_component(model_dir "${model}" DIRECTORY)
  get_filename_component(model_stem "${model}" NAME_WLE)
  foreach(data IN ITEMS "${model}.data" "${model_dir}/${model_stem}.data")
    if(EXISTS "${data}" AND NOT data IN_LIST depends)
      list(APPEND depends "${data}")
    endif()
  endforeach()
  foreach(file IN LISTS arg_DEPENDS)
    get_filename_component(file "${file}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND depends "${file}")
  endforeach()

  # What to compile it for.
  if(arg_TARGET)
    set(build "${arg_TARGET}")
  elseif(FLOWC_TARGET)
    set(build "${FLOWC_TARGET}")
  else()
    set(build "host")
  endif()
  if(NOT build MATCHES "^(host|cuda)$")
    message(FATAL_ERROR "${where}: TARGET must be host or cuda, not '${build}'")
  endif()
  # The C API's functions are <prefix>_create, <prefix>_run, ... (flowc compile --prefix).
  if(DEFINED arg_PREFIX)
    set(prefix "${arg_PREFIX}")
  else()
    set(prefix "${name}")
  endif()
  if(NOT prefix MATCHES "^[A-Za-z_][A-Za-z0-9_]*$")
    message(FATAL_ERROR "${where}: the C symbol prefix '${prefix}' is not a C identifier; "
                        "give one with PREFIX <prefix>")
  endif()
  # Where it goes: the project `flowc compile` writes, a folder of the build tree.
  set(root "${CMAKE_CURRENT_BINARY_DIR}/flowc")
  set(out "${root}/${name}")
  get_property(flowc GLOBAL PROPERTY FLOWC_EXECUTABLE)
  set(cmd "${flowc}" compile "${model}" -o "${out}" --target ${build} --prefix ${prefix})
  if(arg_PRECISION)
    if(NOT arg_PRECISION MATCHES "^(fp32|tf32|bf16|fp16)$")
      message(FATAL_ERROR "${where}: PRECISION must be fp32, tf32, bf16 or fp16, not '${arg_PRECISION}'")
    endif()
    list(APPEND cmd --precision ${arg_PRECISION})
  endif()
  # The mesh fixes the weights files (one per rank), which CMake must know now.
  set(ranks 1)
  if(arg_MESH)
    if(NOT arg_MESH MATCHES "^[1-9][0-9]*(x[1-9][0-9]*)*$")
      message(FATAL_ERROR "${where}: MESH must be N or AxB (devices), not '${arg_MESH}'")
    endif()
    string(REPLACE "x" ";" dims "${arg_MESH}")
    foreach(d IN LISTS dims)
      math(EXPR ranks "${ranks} * ${d}")
    endforeach()
    list(APPEND cmd --mesh ${arg_MESH})
  endif()
  if(build STREQUAL "cuda")
    if(arg_ARCH)
      set(arch "${arg_ARCH}")
    else()
      set(arch "${FLOWC_CUDA_ARCH}")
    endif()
    string(REGEX REPLACE "^sm_" "" arch "${arch}")
    if(NOT arch MATCHES "^[1-9][0-9]+$")
      message(FATAL_ERROR "${where}: ARCH must be a CUDA architecture such as 90 or sm_90, not '${arch}'")
    endif()
    list(APPEND cmd --arch sm_${arch})
  endif()
  if(arg_WEIGHTS)
    get_filename_component(weights_in "${arg_WEIGHTS}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    list(APPEND cmd --weights "${weights_in}")
    list(APPEND depends "${weights_in}")
  endif()
  foreach(option IN LISTS arg_OPTIONS)
    if(option MATCHES "^(-o|--output|--target|--prefix|--precision|--mesh|--arch|--weights)(=.*)?$")
      message(FATAL_ERROR "${where}: OPTIONS ${option}: give it as flowc_add_model's own argument "
                          "(the output folder is flowc_add_model's)")
    endif()
  endforeach()
  list(APPEND cmd ${arg_OPTIONS})

  # What `flowc compile` writes, known now: the library's source and header, the weights.
  if(ranks EQUAL 1)
    set(weights "${out}/weights.bin")
  else()
    set(weights "")
    math(EXPR last "${ranks} - 1")
    foreach(r RANGE ${last})
      list(APPEND weights "${out}/weights.rank${r}.bin")
    endforeach()
  endif()
  # The stamp is the command's one output; the project's files are its byproducts. flowc
  # leaves a file whose bytes are unchanged alone (its time too), so a model edited in a way
  # that changes nothing compiled rebuilds nothing, with Make as with Ninja (an OUTPUT list
  # would have Make touch the files it did not change, or run flowc again at every build).
  set(stamp "${root}/${name}.stamp")
  set(check "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/flowc-check-project.cmake")
  file(RELATIVE_PATH shown "${CMAKE_SOURCE_DIR}" "${model}")
  if(shown MATCHES "^\\.\\./")
    set(shown "${model}")
  endif()
  add_custom_command(
    OUTPUT "${stamp}"
    BYPRODUCTS "${out}/model.cu" "${out}/model.h" ${weights}
    COMMAND ${cmd}
    COMMAND "${CMAKE_COMMAND}" "-DOUT=${out}" "-DRANKS=${ranks}" "-DNAME=${name}" -P "${check}"
    COMMAND "${CMAKE_COMMAND}" -E touch "${stamp}"
    DEPENDS ${depends} "${flowc}" "${check}"
    COMMENT "flowc: compiling model ${name} from ${shown}"
    VERBATIM)

  # The library: the model's code compiled with hidden visibility, exporting <prefix>_* only.
  set(multi "")
  if(ranks GREATER 1)
    set(multi MULTI_RANK)
  endif()
  add_library(${name}_objects OBJECT "${out}/model.cu")
  add_library(${name} SHARED)
  flowc_model_library(${name} ${prefix}_ ${build} ${multi})
  # After flowc_model_library, which gives every source of the objects a language.
  target_sources(${name}_objects PRIVATE "${stamp}")
  set_target_properties(${name}_objects PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
  if(build STREQUAL "cuda")
    set_target_properties(${name}_objects ${name} PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
                                                             CUDA_ARCHITECTURES ${arch})
    set_target_properties(${name} PROPERTIES INSTALL_RPATH "${FLOWC_CUDA_LIB_DIRS}")
  endif()
  # Without a build type (a single-configuration generator), the model's code at -O2: the
  # generated code at -O0 is many times slower.
  get_property(multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
  if(NOT multi_config AND NOT CMAKE_BUILD_TYPE)
    target_compile_options(${name}_objects PRIVATE -O2)
  endif()
  include(GNUInstallDirs)
  target_include_directories(${name} PUBLIC "$<BUILD_INTERFACE:${root}>"
                                            "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
  set_target_properties(${name} PROPERTIES FLOWC_PROJECT_DIR "${out}" FLOWC_WEIGHTS "${weights}"
                                           FLOWC_PREFIX "${prefix}" FLOWC_BUILD "${build}")
  set(${name}_PROJECT_DIR "${out}" PARENT_SCOPE)
  set(${name}_WEIGHTS "${weights}" PARENT_SCOPE)

  # cmake --install: the library, its header as include/<name>/model.h (as it is included
  # from the build tree), the weights in share/<name>/.
  if(NOT arg_NO_INSTALL)
    install(TARGETS ${name} LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
                            RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
                            ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}")
    install(FILES "${out}/model.h" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${name}")
    install(FILES ${weights} DESTINATION "${CMAKE_INSTALL_DATADIR}/${name}")
  endif()
endfunction()
