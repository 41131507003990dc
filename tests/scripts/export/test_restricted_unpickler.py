"""The reader of torch.save's zip format that runs without torch: it rebuilds tensors laid
out as torch stores them, and refuses any pickle that asks for something else, before
running it."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors

from conftest import GOLDEN_TINY, TORCH_FIXTURES, export_error
from m3export.errors import ExportError
from m3export.torch_zip import read_torch_zip

LAYOUTS = TORCH_FIXTURES / "layouts.pt"


def expected_layouts() -> dict[str, tuple[str, list[int], bytes]]:
    """layouts_expected.safetensors through the safetensors package (raw bytes: BF16 too)."""
    return {name: (v["dtype"], v["shape"], bytes(v["data"]))
            for name, v in safetensors.deserialize((TORCH_FIXTURES / "layouts_expected.safetensors").read_bytes())}


def test_offsets_strides_shared_storages_and_dtypes_are_rebuilt():
    got = read_torch_zip(LAYOUTS)
    want = expected_layouts()
    assert set(got) == set(want)
    for name, (dtype, shape, data) in want.items():
        t = got[name]
        assert t.dtype.name == dtype, name
        assert list(t.shape) == shape, name
        assert t.data.tobytes() == data, name
    # One storage behind two names: the same bytes, read once.
    assert np.shares_memory(got["shared_a"].data, got["shared_b"].data)


def test_same_result_as_torch_load():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI keeps it out); the comparison runs where it is")
    from m3export.torch_load import read_with_torch
    ours, theirs = read_torch_zip(LAYOUTS), read_with_torch(LAYOUTS)
    assert set(ours) == set(theirs)
    for name in ours:
        assert ours[name].dtype is theirs[name].dtype and np.array_equal(ours[name].data, theirs[name].data), name


class RunsACommand:
    """What a malicious checkpoint pickles: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def torch_zip(path: Path, pickled: bytes, records: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3")
        for name, data in (records or {}).items():
            z.writestr(f"archive/data/{name}", data)
    return path


def test_a_pickle_that_would_run_a_command_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    # Sanity: plain pickle would run it.
    pickle.loads(pickle.dumps(RunsACommand(tmp_path / "plain")))
    assert (tmp_path / "plain").exists()

    path = torch_zip(tmp_path / "evil.bin", pickle.dumps({"w": RunsACommand(marker)}, protocol=2))
    with pytest.raises(ExportError) as e:
        read_torch_zip(path)
    assert str(e.value) == (
        f"{path}: refused: the pickle asks for posix.system, which a checkpoint of tensors does not need "
        "(allowed: torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, collections.OrderedDict, "
        "torch.<type>Storage); nothing from it was run")
    assert not marker.exists()


def test_the_exporter_refuses_it_too(tmp_path):
    marker = tmp_path / "ran"
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(GOLDEN_TINY / "config.json", src / "config.json")
    for protocol in (2, 4):  # GLOBAL and STACK_GLOBAL
        torch_zip(src / "pytorch_model.bin", pickle.dumps(RunsACommand(marker), protocol=protocol))
        message = export_error(src, tmp_path / "out", "--pickle-reader", "restricted")
        assert message.startswith(f"{src}/pytorch_model.bin: refused: the pickle asks for posix.system")
        assert not marker.exists()
        assert not (tmp_path / "out").exists()


def test_other_callables_are_refused_by_name(tmp_path):
    path = torch_zip(tmp_path / "c.bin", pickle.dumps({"w": json.loads}, protocol=2))
    with pytest.raises(ExportError, match=r"refused: the pickle asks for json\.loads,"):
        read_torch_zip(path)


def test_a_persistent_id_other_than_a_storage_is_refused(tmp_path):
    class Pid(pickle.Pickler):
        def persistent_id(self, obj):
            return ("module", "os") if obj == "x" else None

    import io
    buf = io.BytesIO()
    Pid(buf, protocol=2).dump({"w": "x"})
    path = torch_zip(tmp_path / "p.bin", buf.getvalue())
    with pytest.raises(ExportError, match=r"refused: persistent id \('module', 'os'\) is not a storage record"):
        read_torch_zip(path)


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of the archive `src` whose records pass through `edit(name, data)` (None drops one)."""
    with zipfile.ZipFile(src) as original, zipfile.ZipFile(dst, "w") as z:
        for info in original.infolist():
            data = edit(info.filename, original.read(info))
            if data is not None:
                z.writestr(info.filename, data)
    return dst


def test_a_short_storage_record_is_refused(tmp_path):
    # The first storage (offset_view's, 64 floats) cut to 16 floats.
    path = rewrite(LAYOUTS, tmp_path / "short.pt", lambda n, d: d[:64] if n.endswith("/data/0") else d)
    with pytest.raises(ExportError, match=r"storage 0 holds 64 bytes, the pickle says 64 F32 elements \(256 bytes\)"):
        read_torch_zip(path)


def test_a_tensor_past_its_storage_is_refused(tmp_path):
    # The pickle's record of storage 0 says 16 elements instead of 64; offset_view, at
    # offset 10 with size [3, 4], then reaches element 21.
    def edit(name, data):
        if name.endswith("data.pkl"):
            assert data.count(b"X\x03\x00\x00\x00cpuq\x07K@t") == 1
            return data.replace(b"X\x03\x00\x00\x00cpuq\x07K@t", b"X\x03\x00\x00\x00cpuq\x07K\x10t")
        return data
    path = rewrite(LAYOUTS, tmp_path / "past.pt", edit)
    with pytest.raises(ExportError) as e:
        read_torch_zip(path)
    assert str(e.value) == (f"{path}: a tensor of size [3, 4] at offset 10 with strides [4, 1] reaches element 21 "
                            "of storage 0, which holds 16")


def test_a_missing_storage_record_is_named(tmp_path):
    path = rewrite(LAYOUTS, tmp_path / "missing.pt", lambda n, d: None if n.endswith("/data/0") else d)
    with pytest.raises(ExportError, match=r"refers to storage 0, but the archive has no record layouts/data/0"):
        read_torch_zip(path)


def test_the_legacy_format_is_named(tmp_path):
    path = tmp_path / "legacy.bin"
    path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C) + b"rest of a legacy torch.save file")
    with pytest.raises(ExportError) as e:
        read_torch_zip(path)
    assert str(e.value).startswith(f"{path}: not a zip archive; only torch.save's zip format (PyTorch 1.6 and later)")


def test_a_state_dict_is_required(tmp_path):
    path = torch_zip(tmp_path / "list.bin", pickle.dumps([1, 2], protocol=2))
    with pytest.raises(ExportError, match=r"holds a list, expected a state dict"):
        read_torch_zip(path)
    path = torch_zip(tmp_path / "int.bin", pickle.dumps({"step": 3}, protocol=2))
    with pytest.raises(ExportError, match=r"state dict entry step is a int, not a tensor"):
        read_torch_zip(path)


def test_torch_load_refuses_it_too(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI keeps it out); the torch path is checked where it is")
    marker = tmp_path / "ran"
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(GOLDEN_TINY / "config.json", src / "config.json")
    torch_zip(src / "pytorch_model.bin", pickle.dumps(RunsACommand(marker), protocol=2))
    assert export_error(src, tmp_path / "out", "--pickle-reader", "torch") == (
        f"{src}/pytorch_model.bin: torch.load(weights_only=True) refused it: UnpicklingError: Trying to load "
        "unsupported GLOBAL posix.system whose module posix is blocked.")
    assert not marker.exists()
