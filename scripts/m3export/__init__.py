"""Export of mamba-ssm checkpoints to m3serve model directories.

A checkpoint directory as mamba-ssm's ``save_pretrained`` writes it (config.json with
pytorch_model.bin), or with model.safetensors (single or sharded), becomes a directory
m3serve loads: config.json and model.safetensors (or shards with an index). Every tensor
is checked against the config by the rules of the C++ loader (model/config.cc,
model/weights.cc) before anything is written. No code from a checkpoint is executed.
"""
