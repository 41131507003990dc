// Stand-ins for libm3_spm.so that a tokenizer must refuse: one exports only the version
// function; with M3_FAKE_SHIM_COMPLETE it exports everything but claims version 999.
#include <cstddef>
#include <cstdint>

extern "C" {

__attribute__((visibility("default"))) int m3_spm_abi_version(void) { return 999; }

#ifdef M3_FAKE_SHIM_COMPLETE
__attribute__((visibility("default"))) void* m3_spm_load(const char*, char*, size_t) {
  return nullptr;
}
__attribute__((visibility("default"))) void m3_spm_free(void*) {}
__attribute__((visibility("default"))) int32_t m3_spm_piece_count(const void*) { return 0; }
__attribute__((visibility("default"))) int64_t m3_spm_encode(const void*, const char*, size_t,
                                                             int32_t*, size_t, char*, size_t) {
  return -1;
}
__attribute__((visibility("default"))) int64_t m3_spm_decode(const void*, const int32_t*, size_t,
                                                             char*, size_t, char*, size_t) {
  return -1;
}
__attribute__((visibility("default"))) int64_t m3_spm_id_surface(const void*, int32_t, char*,
                                                                 size_t, char*, size_t) {
  return -1;
}
#endif

}  // extern "C"
