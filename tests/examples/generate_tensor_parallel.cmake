# vlmgen-generate on random tiny checkpoints of each Qwen-VL family: with --nproc 2 (two local
# ranks, tensor parallel, with and without sequence parallelism) it must stream the same tokens as
# one process, for a text prompt (sampled) and a prompt with an image (greedy), the latter also with
# a bfloat16 KV cache.
#   cmake -DGENERATE=... -DMAKE_CHECKPOINT=... -DIMAGE=... -DWORK_DIR=... -P generate_tensor_parallel.cmake
file(REMOVE_RECURSE ${WORK_DIR})

function(tokens_of out_var family)
  execute_process(COMMAND ${GENERATE} --checkpoint ${WORK_DIR}/${family} --max-new-tokens 8 --timeout 20 ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  if(rc)
    message(FATAL_ERROR "${family}: vlmgen-generate ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  string(REGEX MATCH "tokens:[ 0-9]*" tokens "${out}")
  if(NOT tokens)
    message(FATAL_ERROR "${family}: vlmgen-generate ${ARGN} printed no tokens:\n${out}\n${err}")
  endif()
  message(STATUS "${family} ${ARGN}: ${tokens}")
  set(${out_var} "${tokens}" PARENT_SCOPE)
endfunction()

foreach(family qwen2_vl qwen2_5_vl qwen3_vl)
  execute_process(COMMAND ${MAKE_CHECKPOINT} --out ${WORK_DIR}/${family} --family ${family} --seed 3
                  RESULT_VARIABLE rc OUTPUT_QUIET)
  if(rc)
    message(FATAL_ERROR "vlmgen-make-tiny-checkpoint --family ${family} failed: ${rc}")
  endif()
  set(text --prompt "5 6 7 8 9 10 11" --temperature 0.7 --seed 11)
  set(picture --prompt "5 6 <image> 7 8" --image ${IMAGE})
  tokens_of(single ${family} ${text})
  tokens_of(tp ${family} ${text} --nproc 2)
  tokens_of(tp_sp ${family} ${text} --nproc 2 --sequence-parallel)
  tokens_of(tp_no_cache ${family} ${text} --nproc 2 --sequence-parallel --no-kv-cache)
  foreach(run tp tp_sp tp_no_cache)
    if(NOT "${${run}}" STREQUAL "${single}")
      message(FATAL_ERROR "${family}: ${run} streamed '${${run}}' but one process streamed '${single}'")
    endif()
  endforeach()
  tokens_of(image_single ${family} ${picture})
  tokens_of(image_no_cache ${family} ${picture} --no-kv-cache)
  tokens_of(image_tp_sp ${family} ${picture} --nproc 2 --sequence-parallel)
  foreach(run image_no_cache image_tp_sp)
    if(NOT "${${run}}" STREQUAL "${image_single}")
      message(FATAL_ERROR "${family}: ${run} streamed '${${run}}' but one process with the KV cache '${image_single}'")
    endif()
  endforeach()
  # A bfloat16 KV cache: two ranks (each rounding its own heads' keys and values) stream what one does.
  tokens_of(image_kv16 ${family} ${picture} --kv-dtype bf16)
  tokens_of(image_tp_kv16 ${family} ${picture} --kv-dtype bf16 --nproc 2)
  if(NOT "${image_tp_kv16}" STREQUAL "${image_kv16}")
    message(FATAL_ERROR "${family}: --kv-dtype bf16 --nproc 2 streamed '${image_tp_kv16}' but one process '${image_kv16}'")
  endif()
  # An FP8 KV cache: each key and value row (one head of one token) has its own scale, so two ranks
  # (each encoding its own heads' rows) stream what one does.
  tokens_of(image_kv8 ${family} ${picture} --kv-dtype fp8)
  tokens_of(image_tp_kv8 ${family} ${picture} --kv-dtype fp8 --nproc 2)
  if(NOT "${image_tp_kv8}" STREQUAL "${image_kv8}")
    message(FATAL_ERROR "${family}: --kv-dtype fp8 --nproc 2 streamed '${image_tp_kv8}' but one process '${image_kv8}'")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
