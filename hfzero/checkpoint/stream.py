"""Safetensors files written one tensor at a time, and read one slice at a time.

``safetensors.torch.save_file`` turns every tensor into ``bytes`` before writing, so saving a
shard holds a second copy of it. Here the header is computed from the tensors' dtypes and shapes
up front and each tensor's bytes go straight from its storage to the file (a device tensor is
copied to the CPU one at a time): resident memory while writing is one tensor, whatever the file
size. The SHA-256 of the file is computed while writing, so it is never read back. Files are
standard safetensors: ``safetensors.safe_open`` reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from hfzero.checkpoint.errors import CheckpointError

_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_HASH_CHUNK = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling used in manifests and HF configs)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint manifest")
    return dtype


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file being written: its name, dtype and shape (its bytes come later)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class FileDigest:
    """What the manifest records about a written file."""

    sha256: str
    bytes: int


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for entry in entries:
        if entry.dtype not in _DTYPE_CODES:
            raise CheckpointError(f"cannot store tensor {entry.name!r} of dtype {entry.dtype} in safetensors")
        if entry.name in header:
            raise CheckpointError(f"tensor name {entry.name!r} appears twice in one file")
        header[entry.name] = {"dtype": _DTYPE_CODES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> FileDigest:
    """Write ``data`` to ``path`` and fsync it; return its digest."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(hashlib.sha256(data).hexdigest(), len(data))


def write_safetensors(path: Path, entries: Sequence[TensorEntry], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None) -> FileDigest:
    """Write ``tensors`` (in the order of ``entries``, produced lazily) to ``path``; fsync; return the digest.

    Resident memory: one tensor of ``tensors`` at a time (plus its CPU copy if it lives on a device).
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        head = _header(entries, metadata)
        f.write(head)
        digest.update(head)
        size += len(head)
        for entry, tensor in zip(entries, tensors, strict=True):
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise CheckpointError(f"tensor {entry.name!r} is {tensor.dtype} {tuple(tensor.shape)}, announced as "
                                      f"{entry.dtype} {entry.shape}")
            data = _tensor_bytes(tensor)
            f.write(data)
            digest.update(data)
            size += data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(digest.hexdigest(), size)


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (resident memory: one chunk)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _reading(path: Path, key: str) -> Iterator[None]:
    """Report any failure to read ``key`` from ``path`` (safetensors' own error types, OSError) as CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...: name the file, not the library
        raise CheckpointError(f"{path}: cannot read tensor {key!r} ({type(exc).__name__}: {exc}); the file is "
                              "corrupt or unreadable") from None


def read_range(path: Path, key: str, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the 1-D tensor ``key`` in ``path`` (only those bytes are read).

    The file is opened (memory-mapped) for this one read and closed again, so mapped pages of a
    large file never accumulate in the process's resident set.
    """
    from safetensors import safe_open

    with _reading(path, key):
        with safe_open(str(path), framework="pt") as f:
            return f.get_slice(key)[start:end]


def read_tensor(path: Path, key: str) -> torch.Tensor:
    """The whole tensor ``key`` of ``path`` (the file is opened for this read only)."""
    from safetensors import safe_open

    with _reading(path, key):
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)


def read_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """A safetensors file's tensors (name -> (dtype code, shape)) and its metadata; header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (sl.get_dtype(), tuple(sl.get_shape()))
            return out, dict(f.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); the file is corrupt or was "
                              "written by something else") from None
