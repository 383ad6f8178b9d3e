# Run after a GoogleTest binary is built (tests/CMakeLists.txt, composer_gtest_suites):
# lists its suites and writes OUT, a ctest include file with one test per suite
# (PREFIX.Suite, --gtest_filter=Suite.*), so a suite's tests share one process
# and its start (LibTorch's initialisation is most of a small test's time).
execute_process(COMMAND "${BIN}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc
                WORKING_DIRECTORY "${WD}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BIN} --gtest_list_tests failed (${rc})")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(body "")
foreach(line ${lines})
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(suite ${CMAKE_MATCH_1})
    string(REPLACE "/" "_" name ${suite})
    string(APPEND body "add_test([[${PREFIX}.${name}]] [[${BIN}]] [[--gtest_filter=${suite}.*]] --gtest_also_run_disabled_tests)\n")
    string(APPEND body "set_tests_properties([[${PREFIX}.${name}]] PROPERTIES WORKING_DIRECTORY [[${WD}]] LABELS ${LABEL} TIMEOUT ${TIMEOUT} ENVIRONMENT OMP_NUM_THREADS=1)\n")
  endif()
endforeach()
file(WRITE "${OUT}" "${body}")
