// The model m3serve serves when none is given: random weights of a tiny config,
// generated once into a cache directory, so the README's serve command works on a fresh
// machine. Its outputs are meaningless; it exists to exercise the whole path.
#pragma once

#include <filesystem>
#include <string>

#include "model/config.h"

namespace m3 {

ModelConfig demo_model_config();

// Returns the demo model's directory under `dir` (empty: $XDG_CACHE_HOME/m3serve,
// else $HOME/.cache/m3serve, else the temp directory), writing it there when missing.
// Safe when several servers start at once (written aside, then renamed).
std::filesystem::path ensure_demo_model(const std::string& dir);

}  // namespace m3
