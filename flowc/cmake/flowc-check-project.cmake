# flowc_add_model's build step after `flowc compile` (cmake -DOUT=... -DRANKS=... -DNAME=...
# -P this file): the project in OUT must have the weights files CMake was told about when it
# configured, one per rank of the model's mesh (flowc_model.json's "mesh"; [] is one device).
# A .flow program may name its own mesh, which flowc_add_model cannot see: MESH must say it.
cmake_minimum_required(VERSION 3.20)
set(manifest_file "${OUT}/flowc_model.json")
if(NOT EXISTS "${manifest_file}")
  message(FATAL_ERROR "flowc_add_model(${NAME}): flowc compile wrote no ${manifest_file}")
endif()
file(READ "${manifest_file}" manifest)
string(JSON n ERROR_VARIABLE err LENGTH "${manifest}" mesh)
set(ranks 1)
set(shape "")
if(NOT err AND n GREATER 0)
  math(EXPR last "${n} - 1")
  foreach(i RANGE ${last})
    string(JSON d GET "${manifest}" mesh ${i})
    math(EXPR ranks "${ranks} * ${d}")
    list(APPEND shape "${d}")
  endforeach()
endif()
if(NOT ranks EQUAL RANKS)
  if(ranks EQUAL 1)
    set(fix "leave MESH out")
  else()
    string(REPLACE ";" "x" shape "${shape}")
    set(fix "give it MESH ${shape}")
  endif()
  message(FATAL_ERROR
          "flowc_add_model(${NAME}): the model was compiled for ${ranks} device(s), but CMake "
          "was told ${RANKS} (MESH), and so expects other weights files: ${fix}")
endif()
