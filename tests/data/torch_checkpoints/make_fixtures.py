#!/usr/bin/env python3
"""Writes the torch.save fixtures of the exporter's tests (needs torch; the tests do not).

  mamba_ssm_tiny/  config.json + pytorch_model.bin exactly as mamba-ssm's
                   MambaLMHeadModel.save_pretrained writes them: torch.save(model.state_dict())
                   with lm_head.weight tied to backbone.embedding.weight (one storage), and
                   json.dump(config.__dict__, indent=4). The weights are tests/data/golden_tiny's,
                   so the export must reproduce golden_tiny/trajectory.safetensors.
  errors/<case>/   save_pretrained checkpoints of a small random model, each with one fault
                   the exporter must name: missing_tensor (mixer.D of layer 0 left out),
                   wrong_shape (mixer.dt_bias of 5 elements, config needs 4), nan (one NaN
                   in mixer.in_proj.weight);
  small/, small_sharded/  the same small model without a fault, as one pytorch_model.bin and
                   as two shards with pytorch_model.bin.index.json (as transformers shards);
  layouts.pt       a state dict of tensors laid out as torch may store them: views at storage
                   offsets, a transposed (strided) view, one storage shared by two names, BF16,
                   F16, F64, I64, a scalar and an empty tensor;
  layouts_expected.safetensors  the same tensors made contiguous, written by safetensors,
                   to compare the reader against.

Run from anywhere, in an environment with torch and safetensors (a throwaway one: torch's
PyPI wheels pull several GB of CUDA libraries): python tests/data/torch_checkpoints/make_fixtures.py
torch.save wrote these files with torch 2.15.0; rerunning it rewrites them with the same content.
"""
import json
import os
from collections import OrderedDict

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "golden_tiny")


class Node(torch.nn.Module):
    """A module holding parameters and children under the names a checkpoint uses."""


def module_tree(tensors: "OrderedDict[str, torch.Tensor]") -> torch.nn.Module:
    root = Node()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, Node())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(value.clone()))
    return root


def mamba_config_dict(golden_config: dict) -> dict:
    # MambaConfig's fields in declaration order, as config.__dict__ lists them.
    return {
        "d_model": golden_config["d_model"],
        "d_intermediate": golden_config["d_intermediate"],
        "n_layer": golden_config["n_layer"],
        "vocab_size": golden_config["vocab_size"],
        "ssm_cfg": golden_config["ssm_cfg"],
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": golden_config["rms_norm"],
        "residual_in_fp32": golden_config["residual_in_fp32"],
        "fused_add_norm": golden_config["fused_add_norm"],
        "pad_vocab_size_multiple": golden_config["pad_vocab_size_multiple"],
        "tie_embeddings": golden_config["tie_embeddings"],
    }


def write_mamba_ssm_tiny() -> None:
    golden = load_file(os.path.join(GOLDEN, "model.safetensors"))
    with open(os.path.join(GOLDEN, "config.json")) as f:
        config = json.load(f)
    # Parameters in the order mamba-ssm registers them: the backbone, then the head.
    names = [n for n in golden if n != "lm_head.weight"]
    names.sort(key=lambda n: (not n.startswith("backbone.embedding"), n.startswith("backbone.norm_f"), n))
    assert torch.equal(golden["lm_head.weight"], golden["backbone.embedding.weight"])
    save_pretrained(OrderedDict((n, golden[n]) for n in names), mamba_config_dict(config),
                    os.path.join(HERE, "mamba_ssm_tiny"))


# A small Mamba-3 MIMO config: d_inner 32, 4 heads, R 2, N 8, P 8, padded vocab 24.
SMALL_CONFIG = {
    "d_model": 16, "d_intermediate": 0, "n_layer": 1, "vocab_size": 20,
    "ssm_cfg": {"layer": "Mamba3", "is_mimo": True, "mimo_rank": 2, "d_state": 8, "headdim": 8},
    "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
    "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True,
}
SMALL_SHAPES = OrderedDict([
    ("backbone.embedding.weight", (24, 16)),
    ("backbone.layers.0.mixer.in_proj.weight", (110, 16)),  # 2*32 + 2*16 + 3*4 + 2
    ("backbone.layers.0.mixer.dt_bias", (4,)),
    ("backbone.layers.0.mixer.B_bias", (4, 2, 8)),
    ("backbone.layers.0.mixer.C_bias", (4, 2, 8)),
    ("backbone.layers.0.mixer.B_norm.weight", (8,)),
    ("backbone.layers.0.mixer.C_norm.weight", (8,)),
    ("backbone.layers.0.mixer.D", (4,)),
    ("backbone.layers.0.mixer.mimo_x", (4, 2, 8)),
    ("backbone.layers.0.mixer.mimo_z", (4, 2, 8)),
    ("backbone.layers.0.mixer.mimo_o", (4, 2, 8)),
    ("backbone.layers.0.mixer.out_proj.weight", (16, 32)),
    ("backbone.layers.0.norm.weight", (16,)),
    ("backbone.norm_f.weight", (16,)),
])


def save_pretrained(tensors: "OrderedDict[str, torch.Tensor]", config: dict, out: str) -> None:
    """What MambaLMHeadModel.save_pretrained writes for a model with these parameters."""
    model = module_tree(tensors)
    emb = model.backbone.embedding.weight
    model.add_module("lm_head", torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False))
    model.lm_head.weight = emb  # MambaLMHeadModel.tie_weights
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out, "pytorch_model.bin"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=4)


def write_sharded_bin(tensors: "OrderedDict[str, torch.Tensor]", config: dict, out: str) -> None:
    names = list(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    os.makedirs(out, exist_ok=True)
    weight_map = {}
    for file_name, part in shards.items():
        torch.save(OrderedDict((n, tensors[n]) for n in part), os.path.join(out, file_name))
        weight_map.update({n: file_name for n in part})
    with open(os.path.join(out, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=4)


def write_error_cases() -> None:
    g = torch.Generator().manual_seed(11)
    good = OrderedDict((n, torch.randn(*s, generator=g) * 0.1) for n, s in SMALL_SHAPES.items())
    missing = OrderedDict((n, t) for n, t in good.items() if n != "backbone.layers.0.mixer.D")
    wrong_shape = OrderedDict(good)
    wrong_shape["backbone.layers.0.mixer.dt_bias"] = torch.randn(5, generator=g)
    nan = OrderedDict(good)
    nan["backbone.layers.0.mixer.in_proj.weight"] = good["backbone.layers.0.mixer.in_proj.weight"].clone()
    nan["backbone.layers.0.mixer.in_proj.weight"][3, 7] = float("nan")
    save_pretrained(good, SMALL_CONFIG, os.path.join(HERE, "small"))
    write_sharded_bin(good, SMALL_CONFIG, os.path.join(HERE, "small_sharded"))
    for case, tensors in (("missing_tensor", missing), ("wrong_shape", wrong_shape), ("nan", nan)):
        save_pretrained(tensors, SMALL_CONFIG, os.path.join(HERE, "errors", case))


def write_layouts() -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, generator=g)
    wide = torch.randn(6, 5, generator=g)
    half_base = torch.randn(40, generator=g)
    tensors = OrderedDict()
    tensors["offset_view"] = base[10:22].view(3, 4)          # storage offset 10
    tensors["second_view"] = base[30:34]                     # same storage, offset 30
    tensors["transposed"] = wide.t()                         # strides (1, 5)
    tensors["every_other_row"] = wide[::2]                   # strides (10, 1)
    tensors["shared_a"] = wide                               # one storage, two names
    tensors["shared_b"] = wide
    tensors["bf16"] = torch.randn(3, 7, generator=g).to(torch.bfloat16)
    tensors["bf16_view"] = half_base.to(torch.bfloat16)[5:17].view(4, 3)
    tensors["f16"] = torch.randn(2, 9, generator=g).to(torch.float16)
    tensors["f64"] = torch.randn(5, generator=g).to(torch.float64)
    tensors["i64"] = torch.arange(-3, 9, dtype=torch.int64).view(3, 4)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    torch.save(tensors, os.path.join(HERE, "layouts.pt"))
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, os.path.join(HERE, "layouts_expected.safetensors"))


if __name__ == "__main__":
    write_mamba_ssm_tiny()
    write_error_cases()
    write_layouts()
