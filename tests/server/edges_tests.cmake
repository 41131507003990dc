# Tests of the server's edges (H5): tokenizer shim, metrics, clients. Included from
# tests/server/CMakeLists.txt.

if(TARGET m3cli AND TARGET m3_bench_serve)
  # m3cli and m3bench (its decode flags) run as subprocesses; run_bench_serve() is called
  # in-process.
  add_executable(m3_clients_test ${CMAKE_CURRENT_LIST_DIR}/clients_test.cc)
  target_link_libraries(m3_clients_test PRIVATE
    m3_bench_serve m3_client_support nlohmann_json::nlohmann_json GTest::gtest_main)
  add_dependencies(m3_clients_test m3cli m3bench)
  target_compile_definitions(m3_clients_test PRIVATE M3_TEST_M3CLI="$<TARGET_FILE:m3cli>"
    M3_TEST_M3BENCH="$<TARGET_FILE:m3bench>")
  gtest_discover_tests(m3_clients_test)
endif()

if(TARGET m3_server_metrics)
  add_executable(m3_metrics_test ${CMAKE_CURRENT_LIST_DIR}/metrics_test.cc)
  target_link_libraries(m3_metrics_test PRIVATE m3_server_metrics GTest::gtest_main)
  target_compile_definitions(m3_metrics_test PRIVATE
    M3_TEST_DASHBOARD="${PROJECT_SOURCE_DIR}/configs/grafana/m3serve-dashboard.json")
  gtest_discover_tests(m3_metrics_test)
endif()

find_program(M3_SPM_TRAIN spm_train)
# The shim is loaded with RTLD_DEEPBIND, which the sanitizers' runtimes refuse (the process
# exits): sanitizer builds do not register the tests that load it.
set(M3_SHIM_LOADABLE ON)
if(CMAKE_CXX_FLAGS MATCHES "-fsanitize")
  set(M3_SHIM_LOADABLE OFF)
  message(STATUS "m3serve: sanitizer build: the tokenizer shim cannot be loaded (RTLD_DEEPBIND), "
                 "so the tokenizer and text tests are not registered")
endif()
if(TARGET m3_spm AND M3_SPM_TRAIN AND M3_SHIM_LOADABLE)
  # A tiny model trained at test time (well under a second): nothing binary in git.
  set(M3_TEST_SPM_DIR ${CMAKE_CURRENT_BINARY_DIR}/spm)
  file(MAKE_DIRECTORY ${M3_TEST_SPM_DIR})
  add_test(NAME tokenizer.train_tiny_model
    COMMAND ${M3_SPM_TRAIN}
      --input=${CMAKE_CURRENT_LIST_DIR}/data/spm_corpus.txt
      --model_prefix=${M3_TEST_SPM_DIR}/tiny
      --vocab_size=320 --hard_vocab_limit=false --byte_fallback=true
      --character_coverage=0.98 --model_type=unigram --minloglevel=2)
  set_tests_properties(tokenizer.train_tiny_model PROPERTIES FIXTURES_SETUP m3_spm_model)

  # Shims a tokenizer must refuse.
  add_library(m3_test_partial_shim SHARED ${CMAKE_CURRENT_LIST_DIR}/fake_spm_shim.cc)
  add_library(m3_test_future_shim SHARED ${CMAKE_CURRENT_LIST_DIR}/fake_spm_shim.cc)
  target_compile_definitions(m3_test_future_shim PRIVATE M3_FAKE_SHIM_COMPLETE=1)

  # Links gRPC and protobuf on purpose: the process DEPENDENCY_NOTES.md says crashes
  # when SentencePiece is linked plainly.
  add_executable(m3_tokenizer_test ${CMAKE_CURRENT_LIST_DIR}/tokenizer_test.cc)
  target_link_libraries(m3_tokenizer_test PRIVATE m3_tokenizer m3_proto GTest::gtest_main)
  add_dependencies(m3_tokenizer_test m3_spm m3_test_partial_shim m3_test_future_shim)
  target_compile_definitions(m3_tokenizer_test PRIVATE
    M3_TEST_SPM_SHIM="$<TARGET_FILE:m3_spm>"
    M3_TEST_PARTIAL_SHIM="$<TARGET_FILE:m3_test_partial_shim>"
    M3_TEST_FUTURE_SHIM="$<TARGET_FILE:m3_test_future_shim>"
    M3_TEST_SPM_MODEL="${M3_TEST_SPM_DIR}/tiny.model"
    M3_TEST_SPM_VOCAB="${M3_TEST_SPM_DIR}/tiny.vocab")
  gtest_discover_tests(m3_tokenizer_test PROPERTIES FIXTURES_REQUIRED m3_spm_model)

  if(TARGET m3_server)
    # The whole server with a tokenizer; the shim is copied beside the test executable,
    # where Tokenizer::default_shim_path() looks (as it does beside m3serve).
    add_executable(m3_text_serving_test ${CMAKE_CURRENT_LIST_DIR}/text_serving_test.cc)
    target_link_libraries(m3_text_serving_test PRIVATE m3_server GTest::gtest_main)
    target_compile_definitions(m3_text_serving_test PRIVATE
      M3_TEST_SPM_MODEL="${M3_TEST_SPM_DIR}/tiny.model")
    # Its own directory: the tokenizer tests assert there is no shim beside them.
    set_target_properties(m3_text_serving_test PROPERTIES
      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/text_serving)
    add_custom_command(TARGET m3_text_serving_test POST_BUILD
      COMMAND ${CMAKE_COMMAND} -E copy_if_different $<TARGET_FILE:m3_spm>
              $<TARGET_FILE_DIR:m3_text_serving_test>/)
    add_dependencies(m3_text_serving_test m3_spm)
    gtest_discover_tests(m3_text_serving_test PROPERTIES FIXTURES_REQUIRED m3_spm_model)
  endif()
else()
  message(STATUS "m3serve: no sentencepiece shim or spm_train; tokenizer tests not built")
endif()

# --- vocabulary layout (issue 26): vocab.json, segments, constrained sampling, turn rules ---
if(TARGET m3_spm AND M3_SPM_TRAIN AND M3_SHIM_LOADABLE AND TARGET m3_server)
  add_executable(m3_vocab_serving_test ${CMAKE_CURRENT_LIST_DIR}/vocab_serving_test.cc)
  target_link_libraries(m3_vocab_serving_test PRIVATE m3_server_test_support GTest::gtest_main)
  target_compile_definitions(m3_vocab_serving_test PRIVATE M3_TEST_SPM_MODEL="${M3_TEST_SPM_DIR}/tiny.model")
  # Its own directory with the shim beside it (Tokenizer::default_shim_path()).
  set_target_properties(m3_vocab_serving_test PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/vocab_serving)
  add_custom_command(TARGET m3_vocab_serving_test POST_BUILD
    COMMAND ${CMAKE_COMMAND} -E copy_if_different $<TARGET_FILE:m3_spm> $<TARGET_FILE_DIR:m3_vocab_serving_test>/)
  add_dependencies(m3_vocab_serving_test m3_spm)
  gtest_discover_tests(m3_vocab_serving_test PROPERTIES FIXTURES_REQUIRED m3_spm_model TIMEOUT 300)
endif()
