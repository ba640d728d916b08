"""Sharded loading where scripts call ``from_pretrained``: the one hook into transformers.

transformers 5 already builds every model on the meta device (``PreTrainedModel.get_init_context``
adds ``torch.device("meta")``) and then fills it in ``PreTrainedModel._load_pretrained_model``
(memory-mapping each safetensors file and materializing every tensor whole on every rank). DeepSpeed
ZeRO-3 is switched on inside those same two functions (``is_deepspeed_zero3_enabled``); hfzero
replaces only the second one, while sharded loading is enabled:

- ``_load_pretrained_model`` reads the safetensors headers (``os.pread``, no memory map), maps each
  checkpoint key to the model's name with transformers' own ``rename_source_key`` (renamings and
  the ``base_model_prefix``), checks shapes and dtypes, loads persistent buffers (small), and leaves
  the parameters on meta with a ``PendingWeights`` attached (see [Note: pending weights] in
  runtime/pending.py). It returns transformers' ``LoadStateDictInfo``, so missing and unexpected keys
  are reported, initialized and tied by transformers' ``_finalize_model_loading`` as usual. A model that
  ``prepare`` never reads (a reference, reward, teacher or evaluation model; one run before its Trainer) is
  read whole on its first use (see [Note: pending weights]); ``model.device`` reports where that puts it.

Everything else in ``from_pretrained`` (config, dtype, ``_keep_in_fp32_modules``, tying, generation
config, ``eval()``) is transformers' own code.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from hfzero.logging import get_logger
from hfzero.runtime.pending import PendingParameter, PendingWeights, find_pending, intended_device
from hfzero.runtime.stage3.weights import SafetensorsFile, WeightLoadError

logger = get_logger(__name__)

_lock = threading.Lock()
_depth = 0
"""Active switches: ``sharded_init`` blocks plus run-wide ones; the hook is installed while > 0."""
_explicit = 0
"""Active ``sharded_init`` blocks: they load sharded whatever was prepared before."""
_prepared_at_switch: int | None = None
"""``prepared_count()`` when the first run-wide switch came on (None: none on). Run-wide switches
(``hfzero run``, ZeroTrainingArguments) load sharded only until this process prepares a model: the
models of the run are loaded before (the trained one, DPO's reference model); a model loaded after
training (to evaluate it) loads as usual, whole."""
_original = None


def enable(*, explicit: bool = False) -> None:
    """Turn sharded loading on (``hfzero run --zero_stage N``, ZeroTrainingArguments, stages 0-3: until the
    first ``prepare``; ``explicit``: a ``sharded_init`` block). Each ``enable`` needs one ``disable``."""
    global _depth, _original, _explicit, _prepared_at_switch
    from transformers import PreTrainedModel

    from hfzero.runtime.prepare import prepared_count

    with _lock:
        _install_resize_reads(PreTrainedModel)
        _install_device_report()
        if _depth == 0:
            _original = PreTrainedModel.__dict__["_load_pretrained_model"]
            PreTrainedModel._load_pretrained_model = staticmethod(_load_pending)
        _depth += 1
        if explicit:
            _explicit += 1
        elif _prepared_at_switch is None:
            _prepared_at_switch = prepared_count()


def disable(*, explicit: bool = False) -> None:
    global _depth, _explicit, _prepared_at_switch
    from transformers import PreTrainedModel

    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if explicit:
            _explicit -= 1
        if _depth == _explicit:
            _prepared_at_switch = None  # no run-wide switch left
        if _depth == 0:
            PreTrainedModel._load_pretrained_model = _original


def enable_while(owner: object) -> None:
    """Sharded loading on while ``owner`` lives (and until the first ``prepare``): ZeroTrainingArguments at
    stages 0-3, as transformers ties DeepSpeed's ZeRO-3 switch to the lifetime of its config object."""
    enable()
    weakref.finalize(owner, disable)


def wanted(stage: object, tp_size: int = 1, pipeline: bool = False, ep_size: int = 1) -> bool:
    """Whether a run with these settings loads through the hook: stage 3 (each rank reads its shard) and
    stages 0-2 (each parameter read whole at prepare, one at a time: no second copy, no fp32 copy beside a
    bf16 one), with or without pipeline parallelism (each rank then reads only its stages' parameters: see
    [Note: stage-only builds] in parallel/pipeline/driver.py); not under tensor or expert parallelism (they
    build their own per-rank models) nor with stage "auto" (decided after loading, from the model). ``pipeline`` is
    accepted for the callers' sake and changes nothing."""
    return stage in (0, 1, 2, 3) and tp_size == 1 and ep_size == 1


def is_enabled() -> bool:
    """Whether ``from_pretrained`` called now would load sharded."""
    from hfzero.runtime.prepare import prepared_count

    return _explicit > 0 or (_prepared_at_switch is not None and prepared_count() == _prepared_at_switch)


@contextlib.contextmanager
def sharded_init() -> Iterator[None]:
    """Within this block ``from_pretrained`` leaves the weights in the checkpoint: no rank holds the
    model; ``hfzero.prepare`` (or ZeroTrainer / ZeroAccelerator) reads each rank's part.

    Example::

        with hfzero.sharded_init():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))

    Between the two, weights have no values; a model used before (or without) ``prepare`` is read whole on its
    first use, as ``from_pretrained`` would have read it (see docs/loading.md, "Every model a script loads").
    """
    enable(explicit=True)
    try:
        yield
    finally:
        disable(explicit=True)


def _install_resize_reads(cls) -> None:
    """``resize_token_embeddings`` copies the old rows into the new matrix: for a pending model, the old
    matrix is read whole first (one tensor, as from_pretrained would hold it), so the copy is real.
    Installed once; a model that is not pending goes straight to transformers' code."""
    for attr in ("_get_resized_embeddings", "_get_resized_lm_head"):
        original = cls.__dict__[attr]
        if getattr(original, "_hfzero_reads_pending", False):
            continue

        def resized(self, old, *args, _original=original, **kwargs):
            pending = find_pending(self)
            if pending is not None:
                for param in old.parameters():
                    pending.materialize(param)
            return _original(self, old, *args, **kwargs)

        resized._hfzero_reads_pending = True
        setattr(cls, attr, functools.wraps(original)(resized))


def _install_device_report() -> None:
    """transformers' ``model.device`` is its first parameter's device, meta for a pending model; scripts put
    their inputs there (``inputs.to(model.device)``). For a pending model it reports where the weights go
    instead (``intended_device``: where ``.to()`` sent them, else the CPU), so such inputs are real when the
    first forward loads the weights (see [Note: pending weights]). Installed once; ordinary models read as
    transformers reads them."""
    from transformers.modeling_utils import ModuleUtilsMixin

    original = ModuleUtilsMixin.__dict__.get("device")
    if not isinstance(original, property) or getattr(original.fget, "_hfzero_reports_pending", False):
        return  # another transformers layout: model.device stays transformers' own (meta while pending)

    def device(self) -> torch.device:
        first = next(self.parameters())  # as transformers: StopIteration for a model without parameters
        if isinstance(first, PendingParameter) and first.device.type == "meta":
            return intended_device(first)
        return first.device

    device._hfzero_reports_pending = True
    ModuleUtilsMixin.device = property(functools.wraps(original.fget)(device))


def _default_device(load_config) -> torch.device | None:
    """The one device ``device_map`` names (a load of a model hfzero never prepares puts the values there)."""
    devices = {str(d) if not isinstance(d, int) else f"cuda:{d}" for d in (load_config.device_map or {}).values()}
    devices -= {"disk", "meta"}
    return torch.device(devices.pop()) if len(devices) == 1 else None


def _load_pending(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """``PreTrainedModel._load_pretrained_model`` under sharded loading; see the module docstring."""
    if not is_enabled():  # a run-wide switch after the run's first prepare: load as usual
        return _original.__func__(model, state_dict, checkpoint_files, load_config, expected_keys)
    refusal = _refusal(state_dict, checkpoint_files, load_config)
    if refusal:
        if state_dict is not None or refusal.startswith("quantized"):
            logger.warning("hfzero: sharded loading skipped (%s); loading with transformers", refusal)
            return _original.__func__(model, state_dict, checkpoint_files, load_config, expected_keys)
        raise WeightLoadError(f"hfzero: sharded loading cannot read this checkpoint: {refusal}")
    from transformers.modeling_utils import LoadStateDictInfo

    files = _open_all(checkpoint_files)
    try:
        _check_index(load_config, files)
        meta = model.state_dict(keep_vars=True)
        info = LoadStateDictInfo(missing_keys=set(meta), unexpected_keys=set(), mismatched_keys=set(),
                                 error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
        keys = _match(model, meta, files, load_config, info)
    finally:
        for handle in files.values():
            handle.close()
    PendingWeights(keys, _default_device(load_config)).attach(model)
    logger.info("hfzero: %s: %d parameter tensor(s) left in the checkpoint (sharded loading): hfzero.prepare "
                "(or ZeroTrainer / ZeroAccelerator) reads each rank's part; until then the parameters are on the "
                "meta device, and a use that needs values first loads the model whole (see docs/loading.md)",
                type(model).__name__, len(keys))
    return info, None


def _match(model, meta: dict, files: dict[str, SafetensorsFile], load_config,
           info) -> dict[nn.Parameter, tuple[str, str]]:
    """Each checkpoint key to the model's name (transformers' renamings and prefix), checked; buffers loaded;
    ``info`` updated as transformers' loader updates it. Returns parameter -> (file, key); raises
    WeightLoadError listing every problem (tensor and file named)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    keys: dict[nn.Parameter, tuple[str, str]] = {}
    buffers = {name for name, _ in model.named_buffers()}
    dtype_of = _dtype_plan(load_config)
    problems: list[str] = []
    for path, handle in files.items():
        for key in sorted(handle.entries):
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if name not in meta and key in meta:
                name, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta)
            if name not in meta:
                info.unexpected_keys.add(name)
                continue
            mismatched, problem = _check_entry(key, path, handle, meta[name], pattern)
            info.missing_keys.discard(name)
            if mismatched:  # transformers initializes it with ignore_mismatched_sizes=True
                info.mismatched_keys.add((name, tuple(handle.entries[key][1]), tuple(meta[name].shape)))
            if problem and not (mismatched and load_config.ignore_mismatched_sizes):
                problems.append(problem)
            if problem:
                continue
            if name in buffers:
                shape = handle.entries[key][1]
                _set_buffer(model, name, handle.read(key, 0, math.prod(shape)).view(shape))
                continue
            param = _retype(model, name, meta[name], dtype_of(name))
            param._is_hf_initialized = True
            keys[param] = (path, key)
    if problems:
        raise WeightLoadError(f"hfzero: {load_config.pretrained_model_name_or_path}: {len(problems)} problem(s) "
                              "with the checkpoint: " + "; ".join(problems[:8]))
    return keys


def _check_entry(key: str, path: str, handle: SafetensorsFile, target: torch.Tensor, pattern) -> tuple[bool, str]:
    """(shape mismatch?, why checkpoint tensor ``key`` cannot fill ``target``: '' when it can)."""
    stored_dtype, stored_shape, _ = handle.entries[key]
    if pattern is not None:
        return False, (f"{key} in {path} needs transformers' weight conversion ({pattern}), which sharded loading "
                       "does not run; save the model with save_pretrained first")
    if list(stored_shape) != list(target.shape):
        return True, (f"{key} in {path}: checkpoint shape {list(stored_shape)}, model {list(target.shape)} "
                      "(pass ignore_mismatched_sizes=True to initialize it)")
    if target.is_floating_point() != stored_dtype.is_floating_point:
        return False, (f"{key} in {path}: the checkpoint stores {stored_dtype}, which cannot provide the model's "
                       f"{target.dtype}")
    return False, ""


def _refusal(state_dict, checkpoint_files, load_config) -> str:
    """Why this call cannot load sharded ('' when it can)."""
    if load_config.hf_quantizer is not None:
        return "quantized models are loaded by their quantizer"
    if state_dict is not None:
        return "a state_dict was passed (its tensors are already in memory)"
    if not checkpoint_files:
        return "no checkpoint files"
    if not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return (f"{checkpoint_files[0]} is not a safetensors file; PyTorch .bin checkpoints would need unpickling. "
                "Convert it once with save_pretrained(..., safe_serialization=True)")
    if load_config.device_map is not None and len(set(map(str, load_config.device_map.values()))) > 1:
        return "a device_map over several devices; hfzero places the shards itself (drop device_map)"
    return ""


def _open_all(checkpoint_files) -> dict[str, SafetensorsFile]:
    """Every file's header, read up front on every rank: a missing or truncated file fails here."""
    files: dict[str, SafetensorsFile] = {}
    try:
        for path in checkpoint_files:
            try:
                files[str(path)] = SafetensorsFile(str(path))
            except FileNotFoundError:
                raise WeightLoadError(f"hfzero: the checkpoint's index names {path}, which does not exist") from None
    except BaseException:
        for handle in files.values():
            handle.close()
        raise
    return files


def _check_index(load_config, files: dict[str, SafetensorsFile]) -> None:
    """A sharded save's index maps each tensor to a file: that file must hold it (else transformers would
    report it missing and initialize it at random)."""
    weight_map = (load_config.sharded_metadata or {}).get("weight_map") or {}
    by_name = {os.path.basename(path): handle for path, handle in files.items()}
    for key, filename in sorted(weight_map.items()):
        handle = by_name.get(os.path.basename(str(filename)))
        if handle is not None and key not in handle.entries:
            raise WeightLoadError(f"hfzero: tensor {key!r} is missing from {handle.path}, where the checkpoint's "
                                  "index says it is (a partial or mixed-up save?)")


def _dtype_plan(load_config):
    """name -> dtype forced by ``_keep_in_fp32_modules(_strict)`` (None when not forced)."""
    plan = load_config.dtype_plan or {}
    if not plan:
        return lambda name: None
    from transformers.core_model_loading import build_glob_alternation

    alternation, by_group, _ = build_glob_alternation(list(plan))

    def dtype_of(name: str):
        found = alternation.search(name)
        return plan[by_group[found.lastgroup]] if found is not None else None

    return dtype_of


def _retype(model: nn.Module, name: str, param: nn.Parameter, dtype) -> nn.Parameter:
    """The meta parameter, in ``dtype`` when the dtype plan forces one (a new meta object, not yet tied)."""
    if dtype is None or param.dtype == dtype:
        return param
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    new = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)
    setattr(module, attr, new)
    return new


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._buffers[attr]
    new = value.to(old.dtype).clone()
    new._is_hf_initialized = True
    module._buffers[attr] = new
