"""``hfzero estimate``: the paper's per-device model-state memory, the largest model that fits, and an
activation estimate for a transformer config. See ``docs/estimate.md``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from hfzero.planning import estimate as est
from hfzero.cli import _estimate_pipeline

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class _Request:
    """The validated command line."""

    params: float | None
    config: str | None
    dp: int
    mp: int
    dtype: str
    optimizer: str
    offload_optimizer: bool
    persistent_params: float
    accumulation_steps: int
    accumulation: str
    frozen_params: float
    memory: float | None
    headroom: float
    seq_len: int | None
    batch_size: int | None
    checkpointing: bool
    fused_attention: bool
    attention: str | None
    tp: int
    sp: int
    mlp_tiles: int
    loss_tiles: int
    partition_activations: bool
    cpu_checkpointing: bool
    device: str
    as_json: bool
    nodes: int = 1
    shard_size: int = 0
    secondary_partition: bool = False
    quantize_weights: str | None = None
    quantize_gradients: str | None = None
    quantize_block: int = 256
    quantize_error_feedback: bool = False


def register(subparsers: Any) -> None:
    """Add the ``estimate`` subcommand."""
    parser = subparsers.add_parser(
        "estimate",
        help="per-device model-state memory of ZeRO stages 0-3 (Rajbhandari et al.), largest model that fits",
        description="Per-device model-state bytes for ZeRO stages 0-3 (GB = 1e9 bytes), the largest model that "
        "fits a device, and an activation-memory estimate for a transformer config.",
    )
    size = parser.add_argument_group("model size (one of --params, --config; or only --memory)")
    size.add_argument("--params", metavar="N", help="total parameter count, e.g. 7.5e9")
    size.add_argument("--config", metavar="PATH", help="a Hugging Face config.json or a local model directory")
    layout = parser.add_argument_group("layout and precision")
    layout.add_argument("--dp", metavar="N", default="1", help="data-parallel degree N_d (default 1)")
    layout.add_argument("--mp", metavar="N", default="1", help="model-parallel degree; Ψ = params / mp (default 1)")
    layout.add_argument("--dtype", default="bf16", help="fp32 | bf16 | fp16 (default bf16)")
    layout.add_argument("--optimizer", default="adam", help="adam | adamw | sgd_momentum | sgd (default adam)")
    layout.add_argument("--offload-optimizer", action="store_true",
                        help="ZeRO-Offload: master weights, optimizer states and, from stage 2, fp32 gradients in host "
                             "memory (reported separately)")
    layout.add_argument("--persistent-params", metavar="N", default="0",
                        help="stage 3: parameters kept whole on every rank (default 0)")
    layout.add_argument("--accumulation-steps", metavar="N", default="1",
                        help="micro-batches accumulated per optimizer step (default 1)")
    layout.add_argument("--accumulation", default="auto",
                        help="auto | sharded | local: when micro-batch gradients are reduced (ZeroConfig.accumulation; "
                             "'local' at stages 2-3 holds a full gradient buffer across micro-batches)")
    layout.add_argument("--frozen-params", metavar="N", default="0",
                        help="frozen parameters beside --params/--config's trainable ones (a LoRA fine-tune's base "
                             "weights): parameter bytes only, whole at stages 0-2, /N_d at stage 3 (default 0)")
    layout.add_argument("--nodes", metavar="N", default="1",
                        help="nodes the dp ranks are spread over (consecutive ranks per node): adds the inter-node "
                             "part of the communication (docs/multinode.md; default 1)")
    layout.add_argument("--shard-size", metavar="G", default="0",
                        help="HSDP / MiCS: model states sharded over groups of G ranks, replicated across dp / G "
                             "groups (stages 1-3; default 0: the whole dp world)")
    layout.add_argument("--secondary-partition", action="store_true",
                        help="hpZ at stage 3: backward gathers inside the node; adds the secondary partition's bytes "
                             "per rank (needs --nodes)")
    layout.add_argument("--quantize-weights", choices=("int8",), default=None,
                        help="qwZ: parameter all-gathers block-quantized to int8 (stages 1-3); adds bytes per step")
    layout.add_argument("--quantize-gradients", choices=("int8", "int4"), default=None,
                        help="qgZ: gradient reduce-scatter as quantized all-to-alls, intra- then inter-node")
    layout.add_argument("--quantize-block", metavar="B", default="256",
                        help="elements per quantization scale (default 256)")
    layout.add_argument("--quantize-error-feedback", action="store_true",
                        help="qgZ error feedback: adds its fp32 residuals per rank, a model state (needs "
                             "--quantize-gradients)")
    fit = parser.add_argument_group("fitting")
    fit.add_argument("--memory", metavar="BYTES", help="device memory in bytes, e.g. 32e9: adds max_params per stage")
    fit.add_argument("--headroom", metavar="FRACTION", default=str(est.DEFAULT_HEADROOM),
                     help=f"fraction of --memory kept free when choosing a stage (default {est.DEFAULT_HEADROOM})")
    acts = parser.add_argument_group("activations (need --config)")
    acts.add_argument("--seq-len", metavar="S", help="sequence length")
    acts.add_argument("--batch-size", metavar="B", help="micro-batch size per device")
    acts.add_argument("--checkpointing", action="store_true", help="full activation checkpointing, one per layer")
    acts.add_argument("--attention", metavar="IMPL",
                      help="eager | sdpa | flash_attention_2 ... (default: the config's, else sdpa); eager stores the "
                           "(b, a, s, s) attention probabilities")
    acts.add_argument("--tp", metavar="N", help="tensor-parallel degree for the activations (default: --mp)")
    acts.add_argument("--sp", metavar="S", default="1",
                      help="sequence-parallel degree: each sequence split over S ranks (Ulysses; decoders only)")
    acts.add_argument("--mlp-tiles", metavar="N", default="1",
                      help="ZeroConfig mlp_tiles: each layer's MLP over N slices of the sequence (decoders only)")
    acts.add_argument("--loss-tiles", metavar="N", default="1",
                      help="ZeroConfig loss_tiles: logits + loss over N slices of the sequence (decoders only)")
    acts.add_argument("--partition-activations", action="store_true",
                      help="P_a: each checkpoint kept as a 1/tp slice (needs --checkpointing and --tp > 1)")
    acts.add_argument("--cpu-checkpointing", action="store_true",
                      help="P_a+cpu: checkpoints kept in host memory (needs --checkpointing)")
    acts.add_argument("--device", default="cuda", help="cuda | cpu: dropout masks take 1 byte on CUDA, "
                      "the dtype's width on CPU (default cuda)")
    acts.add_argument("--fused-attention", action="store_true",
                      help="flash / memory-efficient attention: no s x s score tensors are stored")
    _estimate_pipeline.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the estimate; on bad input print one error line to stderr and return 2."""
    if args.pp is not None:
        return _estimate_pipeline.run(args)
    try:
        request = _read_request(args)
        result = _estimate(request)
    except est.EstimateError as exc:
        print(f"hfzero estimate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if request.as_json else _render(result))
    return 0


# --------------------------------------------------------------------------------------------------
# Reading the command line
# --------------------------------------------------------------------------------------------------


def _number(option: str, raw: str | None, what: str, *, integer: bool = False, allow_zero: bool = False) -> Any:
    """``raw`` read as a finite positive (or non-negative) number; None stays None."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if ok and integer:
        ok = value == int(value)
    if not ok:
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise est.EstimateError(f"{option} must be {kind} {bound} ({what}), got {raw!r}")
    return int(value) if integer else value


def _read_request(args: argparse.Namespace) -> _Request:
    if args.params is not None and args.config is not None:
        raise est.EstimateError("give either --params or --config, not both")
    if args.params is None and args.config is None and args.memory is None:
        raise est.EstimateError("give the model size with --params N or --config PATH (or --memory BYTES alone for "
                                "the largest model that fits)")
    headroom = _number("--headroom", args.headroom, "a fraction of --memory", allow_zero=True)
    if headroom >= 1:
        raise est.EstimateError(f"--headroom must be below 1 (a fraction of --memory), got {args.headroom!r}")
    request = _Request(
        params=_number("--params", args.params, "the parameter count, e.g. 7.5e9"),
        config=args.config,
        dp=_number("--dp", args.dp, "the data-parallel degree", integer=True),
        mp=_number("--mp", args.mp, "the model-parallel degree", integer=True),
        dtype=args.dtype,
        optimizer=args.optimizer,
        offload_optimizer=args.offload_optimizer,
        persistent_params=_number("--persistent-params", args.persistent_params, "a parameter count", allow_zero=True),
        accumulation_steps=_number("--accumulation-steps", args.accumulation_steps, "micro-batches per step",
                                   integer=True),
        accumulation=args.accumulation,
        frozen_params=_number("--frozen-params", args.frozen_params, "a parameter count", allow_zero=True),
        memory=_number("--memory", args.memory, "device memory in bytes, e.g. 32e9"),
        headroom=headroom,
        seq_len=_number("--seq-len", args.seq_len, "tokens per sequence", integer=True),
        batch_size=_number("--batch-size", args.batch_size, "sequences per device", integer=True),
        checkpointing=args.checkpointing,
        fused_attention=args.fused_attention,
        attention="sdpa" if args.fused_attention and args.attention is None else args.attention,
        tp=_number("--tp", args.tp if args.tp is not None else args.mp, "the tensor-parallel degree", integer=True),
        sp=_number("--sp", args.sp, "the sequence-parallel degree", integer=True),
        mlp_tiles=_number("--mlp-tiles", args.mlp_tiles, "the MLP tiles", integer=True),
        loss_tiles=_number("--loss-tiles", args.loss_tiles, "the loss tiles", integer=True),
        partition_activations=args.partition_activations,
        cpu_checkpointing=args.cpu_checkpointing,
        device=args.device,
        as_json=args.json,
        nodes=_number("--nodes", args.nodes, "nodes the dp ranks are spread over", integer=True),
        shard_size=_number("--shard-size", args.shard_size, "ranks per shard group, 0 = dp", integer=True,
                           allow_zero=True),
        secondary_partition=args.secondary_partition,
        quantize_weights=args.quantize_weights,
        quantize_gradients=args.quantize_gradients,
        quantize_block=_number("--quantize-block", args.quantize_block, "elements per quantization scale", integer=True),
        quantize_error_feedback=args.quantize_error_feedback,
    )
    if request.quantize_error_feedback and not request.quantize_gradients:
        raise est.EstimateError("--quantize-error-feedback keeps qgZ's residuals: give --quantize-gradients too")
    if request.quantize_gradients == "int4" and request.quantize_block % 2:
        raise est.EstimateError(f"--quantize-block {request.quantize_block} must be even with int4 (two codes per byte)")
    if request.secondary_partition and request.nodes < 2:
        raise est.EstimateError("--secondary-partition keeps a copy sharded inside the node: give --nodes N (N > 1)")
    if request.dp % request.nodes:
        raise est.EstimateError(f"--nodes {request.nodes} must divide --dp {request.dp}")
    if request.shard_size and (request.shard_size < 2 or request.dp % request.shard_size):
        raise est.EstimateError(f"--shard-size {request.shard_size} must be at least 2 and divide --dp {request.dp}")
    _check_activation_options(request)
    est.accumulator_held(2, request.accumulation, request.accumulation_steps)  # validates the policy name
    return request


def _check_activation_options(request: _Request) -> None:
    if (request.seq_len is None) != (request.batch_size is None):
        raise est.EstimateError("the activation estimate needs both --seq-len and --batch-size")
    if request.seq_len is not None and request.config is None:
        raise est.EstimateError("the activation estimate needs the model's shape: pass --config PATH instead of --params")
    if request.seq_len is None and (request.checkpointing or request.fused_attention or request.attention
                                    or request.partition_activations or request.cpu_checkpointing
                                    or request.sp > 1 or request.mlp_tiles > 1 or request.loss_tiles > 1):
        raise est.EstimateError("--checkpointing, --attention, --fused-attention, --partition-activations, "
                                "--cpu-checkpointing, --sp, --mlp-tiles and --loss-tiles need --seq-len and "
                                "--batch-size")
    if request.device not in ("cuda", "cpu"):
        raise est.EstimateError(f"--device must be cuda or cpu, got {request.device!r}")


# --------------------------------------------------------------------------------------------------
# Computing
# --------------------------------------------------------------------------------------------------


def _per_stage(function: Any, first: float, request: _Request, precision: est.PrecisionBytes,
               **extra: Any) -> dict[str, float]:
    """``function(first, dp, stage, ...)`` for every stage, keyed "0".."3"."""
    return {
        str(stage): function(
            first, request.dp, stage, mp=request.mp, param_bytes=precision.param_bytes,
            grad_bytes=precision.grad_bytes, optimizer_k=precision.optimizer_k,
            persistent_params=request.persistent_params, offload_optimizer=request.offload_optimizer,
            accumulation_steps=request.accumulation_steps, accumulation=request.accumulation, **extra,
        )
        for stage in est.STAGES
    }


def _estimate(request: _Request) -> dict[str, Any]:
    precision = est.precision_bytes(request.dtype, request.optimizer)
    params = float(est.params_from_config(request.config)) if request.config else request.params
    result: dict[str, Any] = {
        "params": params, "config": request.config, "dp": request.dp, "mp": request.mp, "dtype": request.dtype,
        "optimizer": request.optimizer, "offload_optimizer": request.offload_optimizer,
        "persistent_params": request.persistent_params, "frozen_params": request.frozen_params,
        "memory": request.memory, "headroom": request.headroom,
        "accumulation_steps": request.accumulation_steps, "accumulation": request.accumulation,
        "bytes_per_param": precision._asdict(),
    }
    result.update(nodes=request.nodes, shard_size=request.shard_size)
    if request.shard_size:  # HSDP: model states as ZeRO over the shard group
        request = dataclasses.replace(request, dp=request.shard_size)
    if params is not None:
        result["model_states_bytes"] = _per_stage(est.model_states_bytes, params, request, precision,
                                                  frozen_params=request.frozen_params)
        dp = result["dp"]
        node_comm = {str(stage): est.node_comm_elements_per_step(
            params / request.mp, dp, stage, nodes=request.nodes, shard_size=request.shard_size if stage else 0,
            accumulation_steps=request.accumulation_steps, accumulation=request.accumulation,
            secondary_partition=request.secondary_partition)
            for stage in est.STAGES}
        if request.secondary_partition and (request.shard_size or dp) > dp // request.nodes:
            result["secondary_partition_bytes"] = est.secondary_partition_bytes(
                params / request.mp, dp // request.nodes, param_bytes=precision.param_bytes,
                persistent_params=request.persistent_params)
        from hfzero.planning.quantized import node_comm_bytes_per_step

        quantized = request.quantize_weights or request.quantize_gradients
        node_bytes = {str(stage): node_comm_bytes_per_step(
            params / request.mp, dp, stage, nodes=request.nodes, shard_size=request.shard_size if stage else 0,
            accumulation_steps=request.accumulation_steps, accumulation=request.accumulation,
            secondary_partition=request.secondary_partition, param_bytes=precision.param_bytes,
            grad_bytes=precision.grad_bytes, quantize_weights=request.quantize_weights if stage else None,
            quantize_gradients=request.quantize_gradients if stage else None, quantize_block=request.quantize_block)
            for stage in est.STAGES}
        result["comm_bytes_per_step"] = {stage: total for stage, (total, _) in node_bytes.items()}
        result["comm_inter_node_bytes_per_step"] = {stage: inter for stage, (_, inter) in node_bytes.items()}
        if quantized:
            result["quantization"] = {"weights": request.quantize_weights, "gradients": request.quantize_gradients,
                                      "block": request.quantize_block}
        if request.quantize_error_feedback:
            from hfzero.planning.quantized import error_feedback_bytes

            result["error_feedback_bytes"] = error_feedback_bytes(params / request.mp, result["dp"],
                                                                  nodes=request.nodes, shard_size=request.shard_size)
        result["comm_elements_per_step"] = {stage: total for stage, (total, _) in node_comm.items()}
        result["comm_inter_node_elements_per_step"] = {stage: inter for stage, (_, inter) in node_comm.items()}
        if request.offload_optimizer:
            result["model_states_cpu_bytes"] = _per_stage(est.model_states_cpu_bytes, params, request, precision)
    if request.config:  # See [Note: stage-3 gather order]: the next unit is gathered ahead whatever its size
        root, units = est.stage3_unit_numels(request.config)
        result["stage3_gathered_bytes"] = est.stage3_gathered_bytes(root, units, request.dp, mp=request.mp,
                                                                    param_bytes=precision.param_bytes)
    activations = _activations(request, precision) if request.seq_len is not None else None
    if activations is not None:
        result["activations"] = activations
    if request.memory is not None:
        result["max_params"] = _per_stage(est.max_params, request.memory, request, precision)
        if params is not None:
            result["auto_stage"] = _auto_stage(params, request, precision, activations)
    return result


def _activations(request: _Request, precision: est.PrecisionBytes) -> dict[str, Any]:
    """The decoder activation model's figures (``hfzero.planning.estimate.decoder_activation_bytes``), with
    Korthikanti et al.'s closed form beside them for reference."""
    config = est.load_hf_config(request.config)
    dtype = precision.param_bytes
    encoder = est.is_encoder_config(config)
    if encoder:  # See [Note: encoder activation model]
        if request.partition_activations or request.sp > 1 or request.mlp_tiles > 1 or request.loss_tiles > 1:
            raise est.EstimateError("--partition-activations, --sp, --mlp-tiles and --loss-tiles are modelled for "
                                    "decoders only")
        estimate = est.encoder_activation_bytes(
            est.EncoderShape.from_hf_config(config), request.seq_len, request.batch_size, dtype=dtype,
            attention=request.attention, checkpointing=request.checkpointing, tp=request.tp,
            cpu=request.cpu_checkpointing, device=request.device)
    else:
        estimate = est.decoder_activation_bytes(
            est.DecoderShape.from_hf_config(config), request.seq_len, request.batch_size, dtype=dtype,
            attention=request.attention, checkpointing=request.checkpointing, tp=request.tp,
            partition=request.partition_activations, cpu=request.cpu_checkpointing, device=request.device,
            sp=request.sp, mlp_tiles=request.mlp_tiles, loss_tiles=request.loss_tiles)
    attention = estimate.inputs["attention"]
    paper = None if encoder or request.sp > 1 or request.mlp_tiles > 1 or request.loss_tiles > 1 else est.activation_bytes(
        est.TransformerShape.from_hf_config(config), request.seq_len, request.batch_size,
        checkpointing=request.checkpointing, dtype_bytes=dtype, tp=request.tp,
        fused_attention=attention in est.FUSED_ATTENTION)
    return {
        "estimate": f"hfzero's {'encoder' if encoder else 'decoder'} activation model (what autograd saves, "
                    "tensor by tensor); an estimate",
        "seq_len": request.seq_len, "batch_size": request.batch_size, "checkpointing": request.checkpointing,
        "attention": attention, "fused_attention": attention in est.FUSED_ATTENTION, "tp": request.tp, "sp": request.sp,
        "mlp_tiles": request.mlp_tiles, "loss_tiles": request.loss_tiles,
        "partition_activations": request.partition_activations, "cpu_checkpointing": request.cpu_checkpointing,
        "device": request.device, "per_layer_bytes": estimate.per_layer, "layers_bytes": estimate.layers,
        "checkpoint_bytes": estimate.checkpoints, "checkpoint_host_bytes": estimate.checkpoints_host,
        "recompute_bytes": estimate.recompute, "loss_work_bytes": estimate.loss_work, "head_bytes": estimate.head, "saved_bytes": estimate.saved,
        "total_bytes": estimate.total, "peak_bytes": estimate.peak, "korthikanti_total_bytes": paper.total if paper else None,
    }


def _auto_stage(params: float, request: _Request, precision: est.PrecisionBytes,
                activations: dict[str, Any] | None) -> int | None:
    """The smallest stage that fits ``--memory`` with headroom and the activation estimate; None if none."""
    try:
        return est.choose_stage(
            params, request.dp, request.memory, headroom=request.headroom,
            reserved_bytes=activations["total_bytes"] if activations else 0.0, mp=request.mp,
            param_bytes=precision.param_bytes, grad_bytes=precision.grad_bytes, optimizer_k=precision.optimizer_k,
            persistent_params=request.persistent_params, offload_optimizer=request.offload_optimizer,
            accumulation_steps=request.accumulation_steps, accumulation=request.accumulation,
            frozen_params=request.frozen_params,
        )
    except est.EstimateError:
        return None


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def _render(result: dict[str, Any]) -> str:
    bpp = result["bytes_per_param"]
    lines = [
        f"dp {result['dp']}, mp {result['mp']}, {result['dtype']} + {result['optimizer']}: "
        f"{bpp['param_bytes']} + {bpp['grad_bytes']} + K={bpp['optimizer_k']} bytes per parameter"
        + (", optimizer states (and gradients from stage 2) offloaded to the host" if result["offload_optimizer"] else "")
        + (f", {result['accumulation_steps']} micro-batches per step (accumulation {result['accumulation']})"
           if result["accumulation_steps"] > 1 else ""),
    ]
    if result["params"] is not None:
        lines.insert(0, f"model: {result['params'] / 1e9:.4g}B parameters" + (f" ({result['config']})" if result["config"] else ""))
    if result["nodes"] > 1 or result["shard_size"]:
        lines.append(f"{result['nodes']} node(s) of {result['dp'] // result['nodes']} rank(s)"
                     + (f"; HSDP at stages 1-3: model states sharded over {result['shard_size']} rank(s), replicated "
                        f"{result['dp'] // result['shard_size']} times" if result["shard_size"] else "")
                     + "; inter-node: the communication that crosses nodes (docs/multinode.md)")
    lines += _stage_table(result)
    if "quantization" in result:
        q = result["quantization"]
        lines.append(f"quantized (weights {q['weights'] or 'no'}, gradients {q['gradients'] or 'no'}, block {q['block']}; "
                     "stage 0 unquantized), bytes per device per step, total / inter-node: " + ", ".join(
                         f"stage {s} {result['comm_bytes_per_step'][s] / _GB:.3g} / "
                         f"{result['comm_inter_node_bytes_per_step'][s] / _GB:.3g} GB" for s in ("1", "2", "3")))
    if "error_feedback_bytes" in result:
        lines.append(f"stages 1-3 with qgZ error feedback also hold {result['error_feedback_bytes'] / _GB:.2f} GB of "
                     "fp32 residuals per device (a model state: held across steps; not in the table above)")
    if "secondary_partition_bytes" in result:
        lines.append(f"stage 3 with hpZ also holds {result['secondary_partition_bytes'] / _GB:.2f} GB of secondary "
                     "partition per device (transient: from a forward to its backward)")
    if "stage3_gathered_bytes" in result:
        lines.append(f"stage 3 also holds up to {result['stage3_gathered_bytes'] / _GB:.2f} GB of gathered parameters "
                     "(transient: the root unit, the block in use and the next one, prefetched)")
    if "activations" in result:
        lines += _activation_lines(result["activations"])
    if "auto_stage" in result:
        stage = result["auto_stage"]
        lines.append(f"smallest stage that fits {result['memory'] / _GB:g} GB with {result['headroom']:.0%} headroom: "
                     + (f"{stage} ({est.STAGE_NAMES[stage]})" if stage is not None else "none"))
    return "\n".join(lines)


def _stage_table(result: dict[str, Any]) -> list[str]:
    columns = [(key, title) for key, title in (("model_states_bytes", "device GB"), ("model_states_cpu_bytes", "CPU GB"),
                                              ("max_params", "max params"), ("comm_elements_per_step", "comm/step"),
                                              ("comm_inter_node_elements_per_step", "inter-node"))
               if key in result]
    header = f"{'stage':<14}" + "".join(f"{title:>14}" for _, title in columns)
    rows = [header]
    for stage in est.STAGES:
        cells = []
        for key, _ in columns:
            value = result[key][str(stage)]
            if key in ("comm_elements_per_step", "comm_inter_node_elements_per_step"):
                cells.append(f"{value / max(result['params'] / result['mp'], 1):>13.2f}Ψ")
            else:
                cells.append(f"{value / 1e9:>13.2f}B" if key == "max_params" else f"{value / _GB:>14.2f}")
        rows.append(f"{stage} {est.STAGE_NAMES[stage]:<12}" + "".join(cells))
    return ["model states per device (GB = 1e9 bytes)" if "model_states_bytes" in result
            else f"largest model whose model states fit {result['memory'] / _GB:g} GB per device"] + rows


def _activation_lines(acts: dict[str, Any]) -> list[str]:
    mode = ", ".join(filter(None, (
        "full checkpointing" if acts["checkpointing"] else "no checkpointing",
        f"attention {acts['attention']}", f"tp {acts['tp']}" if acts["tp"] > 1 else "",
        f"sp {acts['sp']} (seq split)" if acts.get("sp", 1) > 1 else "",
        f"MLP in {acts['mlp_tiles']} tiles" if acts.get("mlp_tiles", 1) > 1 else "",
        f"loss in {acts['loss_tiles']} tiles" if acts.get("loss_tiles", 1) > 1 else "",
        "P_a" if acts["partition_activations"] else "", "checkpoints on the host" if acts["cpu_checkpointing"] else "")))
    lines = [
        f"activations per device, ESTIMATE ({acts['estimate'].split(' (')[0]}): seq {acts['seq_len']}, batch "
        f"{acts['batch_size']}, {mode}",
        f"  one layer    {acts['per_layer_bytes'] / _GB:10.3f} GB",
    ]
    if acts["checkpointing"]:
        lines += [f"  checkpoints  {acts['checkpoint_bytes'] / _GB:10.3f} GB"
                  + (f"  (+ {acts['checkpoint_host_bytes'] / _GB:.3f} GB in host memory)" if acts["cpu_checkpointing"] else ""),
                  f"  recompute    {acts['recompute_bytes'] / _GB:10.3f} GB  (one layer, during its backward)"]
    else:
        lines.append(f"  layers       {acts['layers_bytes'] / _GB:10.3f} GB")
    return lines + [
        f"  head         {acts['head_bytes'] / _GB:10.3f} GB  (ids, final norm, fp32 log-softmax of the logits)",
        f"  loss work    {acts['loss_work_bytes'] / _GB:10.3f} GB  (the loss's backward, before the layers')",
        f"  peak         {acts['peak_bytes'] / _GB:10.3f} GB  (total, or with the loss's backward when larger)",
        f"  total        {acts['total_bytes'] / _GB:10.3f} GB"
        + (f"  (Korthikanti et al. 2022: {acts['korthikanti_total_bytes'] / _GB:.3f} GB)"
           if acts["korthikanti_total_bytes"] is not None else ""),
    ]
