"""Where a stage-3 rank's parameter shard comes from when the model was built on the meta device.

[Note: stage-3 sharded construction]
``init.from_pretrained_sharded`` builds the model with its parameters on the meta device (buffers
on the real device, computed by the modules' constructors), so no rank ever holds the full model.
The stage-3 engine then fills only this rank's slice of each bucket (and persistent parameters
whole) from a ``WeightSource`` instead of broadcasting rank 0's full parameters:

- ``CheckpointSource`` reads, for each parameter overlapping the slice, exactly the bytes of the
  needed flat element range (one ``os.pread`` per parameter piece: safetensors stores tensors
  C-contiguous, so a flat range is a byte range; no memory map, whose touched pages would count as
  resident). Sharded saves (``model.safetensors.index.json``) are followed; tied parameters are found
  under any of their names (a checkpoint usually stores one of them).
- ``InitSource`` (config only, no checkpoint) materializes one *init group* at a time on the CPU
  (a decoder block, or one module outside the blocks that owns parameters directly), runs the
  model's ``_init_weights`` over it under the seed ``seed + crc32(group name)`` and keeps only the
  requested range. Every rank computes identical values without communication; the values are
  deterministic but are not those of ``Model(config)`` under ``torch.manual_seed(seed)``.

Both read each range independently, so the result does not depend on the world size.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from hfzero.logging import get_logger
from hfzero.runtime.layout import Bucket

logger = get_logger(__name__)

READ_CHUNK = 1 << 20
"""Elements read at once when filling a shard (4 MiB in fp32): bounds the transient read buffer."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """A checkpoint cannot provide the model's weights (missing files or names, wrong shapes)."""


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's canonical name (first in ``named_parameters``) -> all its names (tied weights)."""
    canonical: dict[nn.Parameter, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(p, name)
        aliases.setdefault(first, []).append(name)
    return aliases


class WeightSource:
    """Fills flat element ranges of named parameters; subclasses implement ``read``."""

    def __init__(self, device: torch.device):
        self.device = device

    def read(self, name: str, shape: torch.Size, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of parameter ``name`` (of ``shape``) flattened, as a 1-D CPU tensor."""
        raise NotImplementedError

    def fill(self, bucket: Bucket, lo: int, hi: int, out: torch.Tensor) -> None:
        """Write elements ``[lo, hi)`` of ``bucket`` into ``out`` (1-D, ``hi - lo``); padding is left as is."""
        for slot in bucket.slots:
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start >= stop:
                continue
            for piece in range(start, stop, READ_CHUNK):  # transient memory: one chunk, whatever the model
                end = min(stop, piece + READ_CHUNK)
                values = self.read(slot.name, slot.shape, piece - slot.offset, end - slot.offset)
                out[piece - lo: end - lo].copy_(values)

    def read_whole(self, name: str, shape: torch.Size) -> torch.Tensor:
        return self.read(name, shape, 0, math.prod(shape)).view(shape)

    def close(self) -> None:
        """Drop open files and caches (the engine calls nothing after construction)."""


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One safetensors file read by byte ranges: the JSON header once, then ``os.pread`` of the
    exact bytes of an element range (no memory map, so only what a rank reads becomes resident).

    A tensor's flat element range [lo, hi) is one contiguous byte range (safetensors stores tensors
    C-contiguous, little-endian).
    """

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) != 8:
                raise WeightLoadError(f"hfzero: {path} is not a safetensors file (shorter than 8 bytes)")
            length = int.from_bytes(head, "little")
            if length > size - 8:
                raise WeightLoadError(f"hfzero: {path} is not a safetensors file (header length {length})")
            try:
                header = json.loads(os.pread(self._fd, length, 8))
            except ValueError as e:
                raise WeightLoadError(f"hfzero: {path}: unreadable safetensors header: {e}") from None
        except BaseException:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.entries: dict[str, tuple[torch.dtype, list[int], int]] = {}  # name -> (dtype, shape, start)
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            shape, (begin, stop) = list(info["shape"]), info["data_offsets"]
            if dtype is None:
                raise WeightLoadError(f"hfzero: {path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            if stop - begin != math.prod(shape) * dtype.itemsize or self.data_start + stop > size:
                raise WeightLoadError(f"hfzero: {path}: tensor {name!r} has inconsistent offsets (truncated file?)")
            self.entries[name] = (dtype, shape, self.data_start + begin)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor ``name`` flattened, as a 1-D CPU tensor of its stored dtype."""
        dtype, _, start = self.entries[name]
        buffer = torch.empty((hi - lo) * dtype.itemsize, dtype=torch.uint8)  # read straight into it
        if os.preadv(self._fd, [buffer.numpy()], start + lo * dtype.itemsize) != buffer.numel():
            raise WeightLoadError(f"hfzero: {self.path}: short read of {name!r} (file changed while loading?)")
        return buffer.view(dtype)

    def close(self) -> None:
        os.close(self._fd)


class CheckpointSource(WeightSource):
    """Reads ranges of parameters from a Hugging Face model directory's safetensors files."""

    def __init__(self, model_dir: str | os.PathLike, device: torch.device):
        super().__init__(device)
        self.model_dir = os.fspath(model_dir)
        self.weight_map = _weight_map(self.model_dir)
        self._files: dict[str, SafetensorsFile] = {}
        self.resolved: dict[str, str] = {}
        """Canonical parameter name -> the checkpoint key it is read from (set by ``check``)."""
        self.added: dict[str, torch.Tensor] = {}
        """Parameters the checkpoint does not hold, by canonical name, with their initial values (CPU):
        adapters a ``wrap`` added (e.g. peft's LoRA matrices); see ``adopt_wrapped``."""

    def _file(self, key: str) -> SafetensorsFile:
        filename = self.weight_map[key]
        handle = self._files.get(filename)
        if handle is None:
            path = os.path.join(self.model_dir, filename)
            if not os.path.isfile(path):
                raise WeightLoadError(f"hfzero: {self.model_dir}: the index names {filename!r}, which does not exist")
            handle = self._files[filename] = SafetensorsFile(path)
        if key not in handle.entries:
            raise WeightLoadError(f"hfzero: {handle.path}: the index maps {key!r} to this file, which lacks it")
        return handle

    def shape_of(self, key: str) -> list[int]:
        return self._file(key).entries[key][1]

    def check(self, model: nn.Module, names: list[str]) -> None:
        """Resolve every name in ``names`` (canonical parameter names) to a key of the right shape.

        Raises WeightLoadError listing every missing name and every shape mismatch at once.
        """
        aliases = parameter_aliases(model)
        shapes = dict((n, p.shape) for n, p in model.named_parameters())
        missing, mismatched = [], []
        for name in names:
            key = next((a for a in aliases.get(name, [name]) if a in self.weight_map), None)
            if key is None:
                missing.append(name)
                continue
            stored, wanted = self.shape_of(key), list(shapes[name])
            if stored != wanted:
                mismatched.append(f"{key}: checkpoint {stored}, model {wanted}")
            self.resolved[name] = key
        if missing or mismatched:
            parts = []
            if missing:
                parts.append(f"{len(missing)} parameter(s) missing from the checkpoint (e.g. {missing[:5]})")
            if mismatched:
                parts.append(f"{len(mismatched)} shape mismatch(es) ({'; '.join(mismatched[:5])})")
            raise WeightLoadError(f"hfzero: {self.model_dir} does not match the model built from its config: "
                                  + ", ".join(parts) + ". Was it saved from a different model or config?")
        known = {a for n in aliases for a in aliases[n]} | {n for n, _ in model.named_buffers()}
        unexpected = sorted(k for k in self.weight_map if k not in known)
        if unexpected:
            logger.warning("%s: %d checkpoint tensor(s) are not used by the model (e.g. %s)",
                           self.model_dir, len(unexpected), unexpected[:3])

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def adopt_wrapped(self, renamed: dict[str, str], added: dict[str, torch.Tensor]) -> None:
        """After a wrapper renamed the model's parameters (peft: ``base_model.model.<name>``, ``.base_layer``):
        ``renamed`` maps each new canonical name to the name ``check`` resolved; ``added`` holds the values
        of parameters the wrapper created."""
        self.resolved.update({new: self.resolved[old] for new, old in renamed.items() if old in self.resolved})
        self.added.update(added)

    def read(self, name: str, shape: torch.Size, lo: int, hi: int) -> torch.Tensor:
        if name in self.added:
            return self.added[name].reshape(-1)[lo:hi]
        key = self.resolved.get(name, name)
        return self._file(key).read(key, lo, hi)

    def read_key(self, key: str) -> torch.Tensor:
        """A whole tensor by checkpoint key (buffers, frozen parameters)."""
        _, shape, _ = self._file(key).entries[key]
        return self._file(key).read(key, 0, math.prod(shape)).view(shape)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def _weight_map(model_dir: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file name, for a single-file or an index-sharded save."""
    if not os.path.isdir(model_dir):
        raise WeightLoadError(f"hfzero: {model_dir!r} is not a directory (expected a save_pretrained directory)")
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise WeightLoadError(f"hfzero: {index} is not a safetensors index (no 'weight_map'): {e}") from None
        if not isinstance(weight_map, dict):
            raise WeightLoadError(f"hfzero: {index}: 'weight_map' must map tensor names to file names")
        return {str(k): str(v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        handle = SafetensorsFile(single)
        handle.close()
        return {k: SINGLE_FILE for k in handle.entries}
    found = sorted(os.listdir(model_dir))
    raise WeightLoadError(f"hfzero: {model_dir!r} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                          f"found {found[:10]}. Save the model with save_pretrained(..., safe_serialization=True); "
                          "PyTorch .bin checkpoints are not read (they would need unpickling).")


class InitSource(WeightSource):
    """Deterministic fresh initialization, one init group at a time; see [Note: stage-3 sharded construction]."""

    def __init__(self, model: nn.Module, block_names: list[str], device: torch.device, seed: int = 0):
        super().__init__(device)
        self.model = model
        self.seed = seed
        self._group_of: dict[str, str] = {}  # canonical parameter name -> init group (a module name)
        blocks = self._blocks = set(block_names)
        for mname, module in model.named_modules():
            owner = next((b for b in blocks if mname == b or mname.startswith(b + ".")), mname)
            for pname, _ in module.named_parameters(recurse=False):
                self._group_of.setdefault(f"{mname}.{pname}" if mname else pname, owner)
        aliases = parameter_aliases(model)
        self._group_of = {name: next(self._group_of[a] for a in names if a in self._group_of)
                          for name, names in aliases.items()}
        # Shapes and dtypes as built: by the time ranges are read, prepare has given the parameters
        # storage-less real tensors (materialize_meta_params), which must not be copied.
        self._meta = {id(p): (p.shape, p.dtype) for p in model.parameters()}
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def _materialize(self, group: str) -> dict[str, torch.Tensor]:
        """The group's parameters, freshly initialized on the CPU (full names -> tensors)."""
        if self._cached is not None and self._cached[0] == group:
            return self._cached[1]
        self._cached = None
        original = self.model.get_submodule(group)
        memo = {id(p): nn.Parameter(torch.empty(*self._meta[id(p)][:1], dtype=self._meta[id(p)][1], device="meta"),
                                    requires_grad=p.requires_grad) for p in original.parameters()}
        module = copy.deepcopy(original, memo)  # parameters on meta: no memory
        block = group in self._blocks
        module.to_empty(device="cpu", recurse=block)  # a block whole; elsewhere the module's own parameters
        for p in module.parameters(recurse=block):
            p.__dict__.pop("_is_hf_initialized", None)
        torch.manual_seed(self.seed + zlib.crc32(group.encode()))
        if block:
            module.apply(self.model._init_weights)
        else:
            self.model._init_weights(module)
        prefix = f"{group}." if group else ""
        values = {prefix + n: p.detach() for n, p in module.named_parameters(remove_duplicate=False, recurse=block)}
        self._cached = (group, values)
        return values

    def read(self, name: str, shape: torch.Size, lo: int, hi: int) -> torch.Tensor:
        group = self._group_of.get(name)
        if group is None:
            raise WeightLoadError(f"hfzero: no module owns parameter {name!r}")
        return self._materialize(group)[name].reshape(-1)[lo:hi]

    def close(self) -> None:
        self._cached = None


def init_added_values(model: nn.Module, added: list[tuple[str, nn.Parameter]], seed: int) -> dict[str, torch.Tensor]:
    """Initial values (CPU) of parameters a wrapper added on meta, computed by their own initializers:
    each owning module is materialized alone and re-initialized (peft's ``reset_lora_parameters`` for LoRA
    layers, else the module's ``reset_parameters``) under ``seed``; the parameters stay on meta."""
    wanted = {p: name for name, p in added}
    # by (module, attribute): to_empty replaces the parameter objects
    slots = [(m, key, wanted[p]) for m in model.modules() for key, p in m._parameters.items() if p in wanted]
    owners = list({id(m): m for m, _, _ in slots}.values())
    torch.manual_seed(seed)
    for module in owners:
        module.to_empty(device="cpu", recurse=False)
    config = getattr(model, "peft_config", {})
    done: set[int] = set()
    for layer in model.modules():  # LoRA layers initialize their A/B pairs themselves (B = 0)
        if hasattr(layer, "reset_lora_parameters") and hasattr(layer, "lora_A"):
            for adapter in list(layer.lora_A.keys()):
                layer.reset_lora_parameters(adapter, getattr(config.get(adapter), "init_lora_weights", True))
            done.update(id(m) for m in layer.modules())
    for module in owners:
        if id(module) not in done and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    values = {}
    for module, key, name in slots:
        p = module._parameters[key]
        values[name] = p.detach().clone()
        module._parameters[key] = type(p)(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                          requires_grad=p.requires_grad)
    return values


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Construct modules with their parameters on the meta device and their buffers where created.

    Each parameter is created by its module (an untouched ``torch.empty``, no resident memory) and
    moved to meta as it is registered, so initializers that run afterwards touch no memory, while
    buffers computed in constructors (rotary ``inv_freq``) keep their real values.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def materialize_meta_params(params: list[nn.Parameter], device: torch.device) -> None:
    """Give meta parameters a real device and dtype with no storage (0 bytes), keeping their identity.

    The optimizer and tied modules hold these very objects, so their contents are swapped in place
    (``torch.utils.swap_tensors``); the engine then points each at its shard view or at an empty
    tensor. Their shape stays meaningful for the layout; their data must never be read.
    """
    for p in params:
        if p.device.type != "meta":
            continue
        empty = torch.empty(p.shape, dtype=p.dtype, device=device)  # untouched pages, released just below
        empty.untyped_storage().resize_(0)
        torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
