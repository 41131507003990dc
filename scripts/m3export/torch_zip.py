"""A reader of PyTorch checkpoints (torch.save's zip format) that needs no torch and runs
no code from the file.

The archive holds `<prefix>/data.pkl`, a pickle of the state dict, and one
`<prefix>/data/<key>` record per storage. The pickle may only name the few callables a
state dict of tensors needs (torch._utils._rebuild_tensor_v2, collections.OrderedDict, the
torch.*Storage types); everything else is refused before it is looked up. Storages are read
with numpy (mapped, where the record is stored uncompressed, as torch writes it); tensors
that share a storage (tied weights) read the same bytes.

torch.save's legacy format (before PyTorch 1.6, not a zip archive) is not read.
"""
from __future__ import annotations

import collections
import math
import pickle
import struct
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import ExportError
from .tensor import DTYPES, DType, Tensor, contiguous, shape_str

# torch.<name>Storage -> the dtype of its elements.
STORAGE_TYPES: dict[str, str] = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}

ALLOWED = ("torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, collections.OrderedDict, "
           "torch.<type>Storage")


class StorageType:
    """What the pickle gets for GLOBAL torch.FloatStorage and its kin: a dtype, nothing callable."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: DType):
        self.name = name
        self.dtype = dtype


class Storage:
    """One storage record: a flat numpy array of its dtype."""

    __slots__ = ("key", "dtype", "array")

    def __init__(self, key: str, dtype: DType, array: np.ndarray):
        self.key = key
        self.dtype = dtype
        self.array = array


class TensorRecord:
    """A tensor as the pickle rebuilt it: dtype and a C-contiguous array (a view of the
    storage where the tensor is contiguous)."""

    __slots__ = ("dtype", "array")

    def __init__(self, dtype: DType, array: np.ndarray):
        self.dtype = dtype
        self.array = array


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Archive:
    """The zip archive: finds the pickle and reads storage records."""

    def __init__(self, path: Path):
        self.path = path
        self.source = str(path)
        try:
            self.zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise ExportError(
                f"{self.source}: not a zip archive; only torch.save's zip format (PyTorch 1.6 and "
                "later) is read without torch (install torch to read the legacy format, or re-save "
                "the state dict with a current PyTorch)") from None
        except OSError as e:
            raise ExportError(f"{self.source}: cannot open: {e.strerror or e}") from None
        pickles = [n for n in self.zip.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
        pickles = [n for n in pickles if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ExportError(f"{self.source}: expected one <name>/data.pkl in the archive, found "
                              f"{len(pickles)} ({', '.join(pickles) or 'none'}); not a torch.save checkpoint?")
        self.pickle_name = pickles[0]
        self.prefix = pickles[0][: -len("data.pkl")]
        self.byteorder = "little"
        order_name = self.prefix + "byteorder"
        if order_name in self.zip.namelist():
            order = self.zip.read(order_name).decode("ascii", "replace").strip()
            if order not in ("little", "big"):
                raise ExportError(f"{self.source}: record {order_name} says \"{order}\", expected little or big")
            self.byteorder = order

    def read_storage(self, key: str, dtype: DType, numel: int) -> np.ndarray:
        name = f"{self.prefix}data/{key}"
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise ExportError(f"{self.source}: the pickle refers to storage {key}, but the archive has "
                              f"no record {name} (truncated file?)") from None
        want = numel * dtype.itemsize
        if info.file_size < want:
            raise ExportError(f"{self.source}: storage {key} holds {info.file_size} bytes, the pickle says "
                              f"{numel} {dtype.name} elements ({want} bytes)")
        np_dtype = dtype.numpy.newbyteorder("<" if self.byteorder == "little" else ">")
        if info.compress_type == zipfile.ZIP_STORED:
            array = np.memmap(self.path, dtype=np_dtype, mode="r", offset=self._data_offset(info), shape=(numel,))
        else:
            array = np.frombuffer(self.zip.read(name), dtype=np_dtype, count=numel)
        if self.byteorder == "big":
            array = array.astype(dtype.numpy)
        return array

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        # The local file header: 30 bytes, then the name and the extra field (whose length
        # may differ from the central directory's copy).
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ExportError(f"{self.source}: record {info.filename} has a broken local header")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a state dict of tensors; refuses every other callable by name."""

    def __init__(self, stream: IO[bytes], archive: _Archive):
        super().__init__(stream, encoding="utf-8")
        self.archive = archive
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in STORAGE_TYPES:
            return StorageType(name, DTYPES[STORAGE_TYPES[name]])
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise ExportError(
            f"{self.archive.source}: refused: the pickle asks for {module}.{name}, which a checkpoint of "
            f"tensors does not need (allowed: {ALLOWED}); nothing from it was run")

    def persistent_load(self, pid: Any) -> Storage:
        source = self.archive.source
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ExportError(f"{source}: refused: persistent id {pid!r:.80} is not a storage record")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise ExportError(f"{source}: refused: storage {key!r:.40} has type {storage_type!r:.60}, "
                              "not a torch.<type>Storage")
        if not isinstance(key, str) or not _is_int(numel) or numel < 0:
            raise ExportError(f"{source}: refused: malformed storage record {pid!r:.80}")
        if key in self.storages:
            # Tied weights: one storage, read once, shared by every tensor that views it.
            storage = self.storages[key]
            if storage.dtype is not storage_type.dtype:
                raise ExportError(f"{source}: storage {key} is read as {storage.dtype.name} and as "
                                  f"{storage_type.dtype.name}")
            return storage
        storage = Storage(key, storage_type.dtype, self.archive.read_storage(key, storage_type.dtype, numel))
        self.storages[key] = storage
        return storage

    def _rebuild_tensor(self, storage: Any, storage_offset: Any, size: Any, stride: Any,
                        requires_grad: Any = False, backward_hooks: Any = None,
                        metadata: Any = None) -> TensorRecord:
        source = self.archive.source
        if not isinstance(storage, Storage):
            raise ExportError(f"{source}: refused: a tensor is rebuilt from {type(storage).__name__}, not a storage")
        if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
                and all(_is_int(v) and v >= 0 for v in size + stride)
                and _is_int(storage_offset) and storage_offset >= 0):
            raise ExportError(f"{source}: malformed tensor of storage {storage.key}: offset {storage_offset!r:.20}, "
                              f"size {size!r:.60}, stride {stride!r:.60}")
        numel = math.prod(size)  # exact: sizes come from the file
        available = storage.array.shape[0]
        if numel > 0:
            last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= available:
                raise ExportError(f"{source}: a tensor of size {shape_str(size)} at offset {storage_offset} "
                                  f"with strides {shape_str(stride)} reaches element {last} of storage "
                                  f"{storage.key}, which holds {available}")
        itemsize = storage.dtype.itemsize
        base = storage.array[storage_offset:] if numel > 0 else storage.array[:0]
        view = np.lib.stride_tricks.as_strided(base, shape=size, strides=tuple(s * itemsize for s in stride),
                                               writeable=False) if numel > 0 else np.empty(size, storage.dtype.numpy)
        return TensorRecord(storage.dtype, contiguous(view))


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> TensorRecord:
    # A state dict saved with keep_vars=True holds Parameters around the same tensors.
    if not isinstance(data, TensorRecord):
        raise ExportError(f"refused: a parameter wraps {type(data).__name__}, not a tensor")
    return data


def read_torch_zip(path: Path) -> dict[str, Tensor]:
    """The state dict in `path` (name -> tensor), read without torch and without running
    anything from the file."""
    archive = _Archive(path)
    # Storages stay mapped (or copied) after the archive is closed.
    with archive.zip, archive.zip.open(archive.pickle_name) as stream:
        try:
            root = _RestrictedUnpickler(stream, archive).load()
        except ExportError:
            raise
        except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise ExportError(f"{archive.source}: cannot unpickle {archive.pickle_name}: {type(e).__name__}: {e}") from None
    if not isinstance(root, dict):
        raise ExportError(f"{archive.source}: holds a {type(root).__name__}, expected a state dict "
                          "(a dict of tensor names to tensors, as save_pretrained writes)")
    out: dict[str, Tensor] = {}
    for name, value in root.items():
        if not isinstance(name, str):
            raise ExportError(f"{archive.source}: state dict key {name!r:.60} is not a string")
        if not isinstance(value, TensorRecord):
            raise ExportError(f"{archive.source}: state dict entry {name} is a {type(value).__name__}, not a tensor")
        out[name] = Tensor(name, value.dtype, value.array, archive.source)
    return out
