# vlmgen-generate on a random tiny checkpoint: with --nproc 2 (two local ranks, tensor
# parallel, with and without sequence parallelism) it must stream the same tokens as one process.
#   cmake -DGENERATE=... -DMAKE_CHECKPOINT=... -DWORK_DIR=... -P generate_tensor_parallel.cmake
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${MAKE_CHECKPOINT} --out ${WORK_DIR}/tiny --seed 3 RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "vlmgen-make-tiny-checkpoint failed: ${rc}")
endif()

function(tokens_of out_var)
  execute_process(COMMAND ${GENERATE} --checkpoint ${WORK_DIR}/tiny --prompt "5 6 7 8 9 10 11"
                          --max-new-tokens 8 --temperature 0.7 --seed 11 --timeout 20 ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(rc)
    message(FATAL_ERROR "vlmgen-generate ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  string(REGEX MATCH "tokens:[ 0-9]*" tokens "${out}")
  if(NOT tokens)
    message(FATAL_ERROR "vlmgen-generate ${ARGN} printed no tokens:\n${out}\n${err}")
  endif()
  message(STATUS "${ARGN}: ${tokens}")
  set(${out_var} "${tokens}" PARENT_SCOPE)
endfunction()

tokens_of(single)
tokens_of(tp --nproc 2)
tokens_of(tp_sp --nproc 2 --sequence-parallel)
tokens_of(tp_no_cache --nproc 2 --sequence-parallel --no-kv-cache)
foreach(run tp tp_sp tp_no_cache)
  if(NOT "${${run}}" STREQUAL "${single}")
    message(FATAL_ERROR "${run} streamed '${${run}}' but one process streamed '${single}'")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
