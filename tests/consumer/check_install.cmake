# Installs the build tree into a scratch prefix, then configures, builds and runs a consumer
# that finds vlmgen with find_package.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${VLMGEN_BINARY_DIR} --prefix ${WORK_DIR}/prefix
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
set(launcher "")
if(CCACHE)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build -G ${CMAKE_GENERATOR}
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release ${launcher} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()

# The Python package, when built: importable from the prefix alone (its module finds libvlmgen
# relative to itself), and it is the installed copy that loads.
if(PYTHON)
  set(_site ${WORK_DIR}/prefix/${PYTHON_PACKAGE_DIR})
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PYTHONPATH=${_site} PYTHONDONTWRITEBYTECODE=1 ${PYTHON} -c
    "import vlmgen; assert vlmgen.__file__.startswith('${_site}/'), vlmgen.__file__; c = vlmgen.GenerationConfig(max_new_tokens=2); print('python package', vlmgen.__version__, 'from', vlmgen.__file__)"
    WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "importing the installed Python package failed: ${rc}")
  endif()
endif()
