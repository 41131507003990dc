# Tests of what running m3serve in production needs (issue 27): API keys, TLS, the drain,
# status consistency, a soak, and the deploy/ manifests. Included from
# tests/server/CMakeLists.txt. TLS certificates are made at test time with the openssl
# command; the independent client is Debian's python3-grpcio (scripts/setup.sh).

add_executable(m3_production_config_test production_config_test.cc)
target_link_libraries(m3_production_config_test PRIVATE m3_server GTest::gtest_main)
gtest_discover_tests(m3_production_config_test)

add_executable(m3_api_keys_test api_keys_test.cc)
target_link_libraries(m3_api_keys_test PRIVATE m3_server GTest::gtest_main)
add_dependencies(m3_api_keys_test m3cli m3bench)
target_compile_definitions(m3_api_keys_test PRIVATE M3_TEST_M3CLI="$<TARGET_FILE:m3cli>"
  M3_TEST_M3BENCH="$<TARGET_FILE:m3bench>")
gtest_discover_tests(m3_api_keys_test)

add_executable(m3_tls_test tls_test.cc)
target_link_libraries(m3_tls_test PRIVATE m3_server GTest::gtest_main)
add_dependencies(m3_tls_test m3cli)
target_compile_definitions(m3_tls_test PRIVATE M3_TEST_M3CLI="$<TARGET_FILE:m3cli>"
  M3_TEST_PYTHON_CLIENT="${CMAKE_CURRENT_SOURCE_DIR}/grpc_python_client.py")
gtest_discover_tests(m3_tls_test PROPERTIES TIMEOUT 120)

add_executable(m3_drain_test drain_test.cc)
target_link_libraries(m3_drain_test PRIVATE m3_server GTest::gtest_main)
add_dependencies(m3_drain_test m3serve)
target_compile_definitions(m3_drain_test PRIVATE M3_TEST_M3SERVE="$<TARGET_FILE:m3serve>")
gtest_discover_tests(m3_drain_test PROPERTIES TIMEOUT 120)

add_executable(m3_status_consistency_test status_consistency_test.cc)
target_link_libraries(m3_status_consistency_test PRIVATE m3_server_test_support GTest::gtest_main)
gtest_discover_tests(m3_status_consistency_test PROPERTIES TIMEOUT 120)

add_executable(m3_deploy_manifests_test deploy_manifests_test.cc)
target_link_libraries(m3_deploy_manifests_test PRIVATE m3_server GTest::gtest_main)
target_compile_definitions(m3_deploy_manifests_test PRIVATE M3_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
gtest_discover_tests(m3_deploy_manifests_test)
# Kubernetes' own schemas (PyPI's kubernetes-validate; not a Debian package, so optional:
# `pip install kubernetes-validate` puts it on PATH).
find_program(M3_KUBERNETES_VALIDATE kubernetes-validate)
if(M3_KUBERNETES_VALIDATE)
  add_test(NAME m3_deploy_k8s_schemas
           COMMAND ${M3_KUBERNETES_VALIDATE} --strict ${PROJECT_SOURCE_DIR}/deploy/k8s/deployment.yaml
                   ${PROJECT_SOURCE_DIR}/deploy/k8s/service.yaml)
else()
  message(STATUS "kubernetes-validate not found: deploy/k8s is checked by m3_deploy_manifests_test only")
endif()

# About 45 s of mixed clients against an m3serve child (label soak: ctest -L soak).
add_executable(m3_soak_test soak_test.cc)
target_link_libraries(m3_soak_test PRIVATE m3_server GTest::gtest_main)
add_dependencies(m3_soak_test m3serve)
target_compile_definitions(m3_soak_test PRIVATE M3_TEST_M3SERVE="$<TARGET_FILE:m3serve>")
gtest_discover_tests(m3_soak_test PROPERTIES TIMEOUT 180 LABELS soak)
