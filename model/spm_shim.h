// The C interface of libm3_spm.so, the project's SentencePiece shim.
//
// Debian's libsentencepiece carries its own protobuf (3.14) and cannot share a process
// with gRPC's protobuf (3.21) when linked plainly (see DEPENDENCY_NOTES.md). The shim is
// the only code that links it; the server dlopen()s the shim with RTLD_DEEPBIND so each
// side keeps its protobuf. Everything crossing this boundary is plain C: no C++ types,
// no exceptions, caller-owned buffers.
//
// Buffer convention: a function that writes into (out, capacity) returns the full length
// it needs; when that exceeds capacity nothing useful was written and the caller retries
// with a larger buffer. A negative return is an error, described in (error, error_capacity)
// (always NUL-terminated, truncated to fit).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; Tokenizer refuses a shim of another version.
#define M3_SPM_ABI_VERSION 1

typedef struct m3_spm m3_spm;

int m3_spm_abi_version(void);

// Loads a SentencePiece .model file. Null on failure, with the reason in `error`.
m3_spm* m3_spm_load(const char* model_path, char* error, size_t error_capacity);
void m3_spm_free(m3_spm* spm);

int32_t m3_spm_piece_count(const m3_spm* spm);

// Text (UTF-8, `length` bytes) to ids. Returns the number of ids.
int64_t m3_spm_encode(const m3_spm* spm, const char* text, size_t length, int32_t* ids,
                      size_t capacity, char* error, size_t error_capacity);

// Ids to text, with SentencePiece's own rules (the leading word-boundary space of the
// text is dropped, byte pieces are joined into UTF-8). Returns the number of bytes.
int64_t m3_spm_decode(const m3_spm* spm, const int32_t* ids, size_t count, char* text,
                      size_t capacity, char* error, size_t error_capacity);

// The bytes one id contributes in the middle of a text: the piece with its word-boundary
// mark as a space, a byte piece as its single (possibly partial UTF-8) byte, control
// pieces as nothing, the unknown piece as " \u2047 ". Returns the number of bytes.
int64_t m3_spm_id_surface(const m3_spm* spm, int32_t id, char* bytes, size_t capacity,
                          char* error, size_t error_capacity);

#ifdef __cplusplus
}  // extern "C"
#endif
