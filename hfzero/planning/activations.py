"""An activation model for Hugging Face decoders: the bytes autograd saves for backward, tensor by
tensor, as a function of batch, sequence, the config's sizes, dtype, attention implementation,
checkpointing, tensor parallelism, P_a and P_a+cpu. Exported by ``hfzero.planning.estimate``.

[Note: decoder activation model]
Derived by reading what each operation of a transformers decoder layer saves for its backward (the
tensors its backward formula needs), then checked against the list of tensors the saved-tensor hooks
see (which corrected one term: a fused kernel's output and the output projection's input are one
storage); no coefficient is fitted. ``tests/test_activations.py`` checks it against the profiler's
measurement; on CPU (GPT-2 and Llama, fp32 and bf16, eager and sdpa, with and without dropout) it is
exact to the byte without checkpointing. Not checked on CUDA, where sdpa may pick another kernel
(e.g. memory-efficient attention with a padding mask) and LayerNorm keeps fp32 statistics. With s tokens, b sequences, h = a * d
(heads a, head size d), kv key-value heads, MLP width f, element size e and sb = s*b, one layer saves:

- each norm: LayerNorm its input, its output (saved by the next projection) and two (sb,) stats:
  2e*sbh + 2e*sb; RMSNorm its input upcast to fp32, the rsqrt (fp32), the normalized tensor (saved by
  the weight multiply) and its output: 4*sbh + 4*sb + 2e*sbh. Two norms per layer;
- eager attention: Q, K and V at all a heads (the matmul inputs: copies of non-contiguous views, or
  repeat_kv's copy under grouped-query attention), the output projection's input, and the (b, a, s, s)
  probabilities (fp32 softmax: 4 bytes, plus their e-byte copy when e < 4; else e bytes):
  4e*sb*a*d + a*s*s*b*softmax_bytes;
- fused attention (sdpa / flash kernels): Q (a heads), K and V (kv heads), the kernel's output (laid
  out (b, s, a, d), so the output projection's input is a view of it) and its log-sum-exp (fp32):
  e*sb*d*(2a + 2kv) + 4*a*s*b;
- MLP: GPT-style ``act(fc(x))`` saves fc's output (the activation's input) and the activation's output
  (the last projection's input): 2e*sb*f; a gated MLP ``down(act(gate(x)) * up(x))`` saves gate's
  output, act's output, up's output and the product: 4e*sb*f. ``gelu_new`` (transformers' Python tanh
  GELU) saves 3 more f-sized tensors (input, tanh output, 0.5x and 1 + tanh instead of the input);
- dropout in training: the mask per dropout site (1 byte on CUDA; e bytes on CPU, where dropout is a
  multiply by a scaled noise tensor), and after eager attention's dropout its e-byte output. Off CUDA,
  sdpa with attention dropout runs torch's math path and saves what eager attention saves.

Outside the layers (``head``): the token ids (int64) for the embedding backward, learned position ids
(GPT-2), the rotary cos / sin tables (one (s, d) pair, shared by every layer), the final norm, the
logits' fp32 log-softmax (4*sb*V) and the labels (int64), the loss.

Tensor parallelism over t ranks (Megatron-style column / row split of attention and MLP) divides the
per-head and f-sized terms by t; norms, residuals and the head stay whole. Checkpointing one layer
per checkpoint keeps the layer inputs (e*sbh each; with P_a a ceil(sbh/t)-element slice; with P_a+cpu
in host memory) plus the inputs every layer shares that need no gradient (the eager attention mask,
the rotary tables), and during backward one layer's saved set is rebuilt by its recomputation.
Sequence parallelism over S ranks (Ulysses, hfzero/parallel/sequence/) gives each rank s' = ceil(s/S)
positions: every term above is taken at s' (norms, MLP, head, checkpoints), except fused attention, which
runs on the whole sequence at a/S heads after the all-to-all: its Q, output and log-sum-exp are of s x a/S
= s' x a, its K and V of kv*r heads (replicated r = S / gcd(kv, S) times when kv does not split over S),
and the output projection's input is a copy of the all-to-all's result rather than a view of the kernel's
output: e*s'b*d*(3a + 2kv*r) + 4*a*s'b; the loss keeps its divisor (the group's target count, 8 bytes). Eager attention under SP runs as sdpa (attention.py); attention
dropout under SP is not modelled.
The model counts no kernel workspace, no gradients of activations (beyond the loss's ``loss_work``) and no
allocator overhead: its figures are bytes of live tensors. An allocator can keep freed memory resident,
and then a process's peak is above them by a margin that depends on the order of allocations, not on the
model: CUDA's caching allocator (reserved above allocated), and on a CPU host glibc's malloc, whose mmap
threshold is dynamic (after the first free of an mmapped block of up to 32 MiB it rises to that block's
size; later blocks below it come from the heap, and freed heap memory fragmented by smaller allocations
stays resident). Measured (benchmarks/long_context.py, 4 gloo ranks, stage 3 + SP=4 + tiled MLP / loss
(8 tiles) + checkpoints, T=16384): peak RSS 914 MiB with glibc's default against 655 MiB with the threshold
pinned to 128 KiB (``MALLOC_MMAP_THRESHOLD_``), where the prediction is 629 MiB; the phase that grew was the
tiled loss (its slices' 16-33 MB logits fall under the raised threshold). The configurations without tiling
move less (their logits exceed 32 MiB and are always mmapped): within 6.4% either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hfzero.planning.shapes import EstimateError, TransformerShape, load_hf_config

_PYTHON_GELU_EXTRA = {"gelu_new": 3}
"""Extra f-sized tensors saved by activations transformers implements in Python (see the note)."""

FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations that never store the (b, a, s, s) probabilities."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """What sets a transformers decoder's activation memory (see [Note: decoder activation model]).

    Attributes:
        hidden_size: h.
        num_layers: L, the decoder layers.
        num_heads: a, the attention heads.
        num_kv_heads: key-value heads (a without grouped-query attention).
        head_dim: d (h / a in most models).
        vocab_size: V.
        ffn_size: f, the MLP's inner width.
        rms_norm: RMSNorm (Llama family) rather than LayerNorm (GPT-2 family).
        gated_mlp: ``down(act(gate(x)) * up(x))`` rather than ``proj(act(fc(x)))``.
        activation: the MLP activation's transformers name (``gelu_new`` saves more, see the note).
        softmax_fp32: eager attention's softmax runs in fp32 (Llama family) rather than in the dtype.
        rotary: rotary position embeddings (cos / sin tables) rather than learned positions.
        residual_dropout: dropout on the attention and MLP outputs in training.
        attention_dropout: dropout on the attention probabilities in training.
        embedding_dropout: dropout on the embeddings in training.
        attention: the config's attention implementation ("eager", "sdpa", ...), None when unset.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_size: int
    rms_norm: bool
    gated_mlp: bool
    activation: str = "gelu"
    softmax_fp32: bool = False
    rotary: bool = False
    residual_dropout: bool = False
    attention_dropout: bool = False
    embedding_dropout: bool = False
    attention: str | None = None

    @classmethod
    def from_hf_config(cls, source: Any) -> "DecoderShape":
        """Read a decoder's shape from a Hugging Face config (object, config.json or directory).

        The family is read from the config: ``rms_norm_eps`` marks the Llama family (RMSNorm, gated
        MLP, fp32 softmax, rotary positions: Llama, Mistral, Qwen2/3, ...); otherwise the GPT-2 family
        (LayerNorm, ``act(fc(x))`` MLP, learned positions).

        Raises:
            EstimateError: the config lacks a decoder's sizes.
        """

        config = load_hf_config(source)
        base = TransformerShape.from_hf_config(config)
        llama = getattr(config, "rms_norm_eps", None) is not None
        heads = base.num_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or base.hidden_size // heads
        if heads % kv:
            raise EstimateError(f"{type(config).__name__}: num_key_value_heads {kv} does not divide num_attention_heads "
                                f"{heads}")
        activation = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "gelu"

        def positive(*names: str) -> bool:
            return any((getattr(config, n, 0) or 0) > 0 for n in names)

        return cls(hidden_size=base.hidden_size, num_layers=base.num_layers, num_heads=heads, num_kv_heads=int(kv),
                   head_dim=int(head_dim), vocab_size=base.vocab_size, ffn_size=base.ffn_size, rms_norm=llama,
                   gated_mlp=llama, activation=str(activation), softmax_fp32=llama, rotary=llama,
                   residual_dropout=positive("resid_pdrop", "hidden_dropout"),
                   attention_dropout=positive("attn_pdrop", "attention_dropout"),
                   embedding_dropout=positive("embd_pdrop"),
                   attention=getattr(config, "_attn_implementation", None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderActivationEstimate:
    """Activation bytes per device for one micro-batch's forward / backward (an ESTIMATE).

    Attributes:
        per_layer: bytes one layer saves for backward (its working set; rebuilt by recomputation).
        layers: bytes all layers hold after the forward: L * per_layer, or 0 with checkpointing.
        checkpoints: checkpoint bytes on the device (layer inputs and shared inputs as stored: a
            1/tp slice with P_a, 0 with P_a+cpu); 0 without checkpointing.
        checkpoints_host: checkpoint bytes in host memory (P_a+cpu), else 0.
        head: bytes saved outside the layers (ids, positions, final norm, logits, labels).
        saved: what the profiler measures at the forward's end (its ``activations`` +
            ``act_checkpoint`` roles): layers + checkpoints + checkpoints_host + head.
        recompute: with checkpointing, one layer's working set held during its recomputation in
            backward (not seen by the profiler's saved-tensor accounting), plus one MLP slice's with
            ``mlp_tiles``; without checkpointing that slice alone (else 0).
        loss_work: the loss's backward working set beyond the saved tensors (runs before any layer's
            backward, while everything saved is alive): the fp32 gradients of the log-softmax and of the
            logits, 8*sb*V; with ``loss_tiles`` N one slice's rebuilt log-softmax and those two, 12*sb*V/N.
            Measured on CPU (bf16 logits, T=2048, V=32000): the loss's backward peaks 12*sb*V above its
            inputs, of which 4*sb*V is the saved log-softmax. Not modelled for encoders (0).
        total: device bytes of what autograd holds at the activation peak: saved - checkpoints_host +
            recompute (the figure ``hfzero plan`` / autostage reserve and the profiler's roles compare with).
        peak: device bytes at the activation peak including the loss's backward working set:
            saved - checkpoints_host + max(recompute, loss_work): live tensors, without what an allocator
            keeps of freed memory (see the note's last paragraph; benchmarks/long_context.py compares it with
            RSS peaks measured with glibc's mmap threshold pinned).
        inputs: the arguments the estimate was made with.
    """

    per_layer: float
    layers: float
    checkpoints: float
    checkpoints_host: float
    head: float
    saved: float
    recompute: float
    loss_work: float
    total: float
    peak: float
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the profile header's ``activation_prediction``)."""
        return dataclasses.asdict(self)


def _dtype_bytes(dtype: str | int) -> int:

    sizes = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in (2, 4):
        return dtype
    if dtype not in sizes:
        raise EstimateError(f"unknown activation dtype {dtype!r}; use one of fp32, bf16, fp16")
    return sizes[dtype]


def _norm_bytes(shape: DecoderShape, sb: int, e: int) -> float:
    h = shape.hidden_size
    if shape.rms_norm:
        return 4 * sb * h + 4 * sb + 2 * e * sb * h
    return 2 * e * sb * h + 2 * e * sb


def _attention_bytes(shape: DecoderShape, s: int, b: int, e: int, fused: bool, mask: int, tp: int) -> float:
    sb, a, d = s * b, shape.num_heads, shape.head_dim
    if fused:
        return (e * sb * d * (2 * a + 2 * shape.num_kv_heads) + 4 * a * sb) / tp
    softmax = 4 + (e if e < 4 else 0) if shape.softmax_fp32 else e
    scores = a * s * s * b * (softmax + ((mask + e) if shape.attention_dropout else 0))
    return (4 * e * sb * a * d + scores) / tp


def _mlp_bytes(shape: DecoderShape, sb: int, e: int, tp: int) -> float:
    tensors = (4 if shape.gated_mlp else 2) + _PYTHON_GELU_EXTRA.get(shape.activation, 0)
    if shape.activation == "relu" and not shape.gated_mlp:
        tensors = 1  # relu saves its output, which is also the next projection's input
    return tensors * e * sb * shape.ffn_size / tp


def decoder_layer_bytes(shape: DecoderShape, seq_len: int, batch_size: int, *, dtype: str | int = "bf16",
                        attention: str | None = None, tp: int = 1, device: str = "cuda", sp: int = 1) -> float:
    """Bytes one decoder layer saves for backward (see [Note: decoder activation model]).

    ``attention`` defaults to the shape's (the config's ``_attn_implementation``), else "sdpa"
    (transformers' default); ``device`` sets the dropout mask width (1 byte on "cuda", e elsewhere).
    ``sp`` > 1: one rank's share of a sequence split over sp ranks (``seq_len`` is still the whole length).
    """
    e = _dtype_bytes(dtype)
    local = -(-seq_len // sp)
    sb = local * batch_size
    mask = 1 if device == "cuda" else e
    fused = _fused(shape, "sdpa" if sp > 1 and attention == "eager" else attention, device)
    dropout = 2 * mask * sb * shape.hidden_size if shape.residual_dropout else 0
    if sp > 1:
        attn = _sequence_attention_bytes(shape, local, batch_size, e, fused, sp)
    else:
        attn = _attention_bytes(shape, seq_len, batch_size, e, fused, mask, tp)
    return 2 * _norm_bytes(shape, sb, e) + attn + _mlp_bytes(shape, sb, e, tp) + dropout


def _sequence_attention_bytes(shape: DecoderShape, local: int, b: int, e: int, fused: bool, sp: int) -> float:
    """Fused attention after the Ulysses all-to-all, per rank (see the note's sequence-parallel paragraph)."""

    if not fused:
        raise EstimateError("sequence parallelism with attention dropout (torch's math attention) is not modelled")
    a, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    replicated = kv * (sp // math.gcd(kv, sp))
    sb = local * b
    return e * sb * d * (3 * a + 2 * replicated) + 4 * a * sb


def _fused(shape: DecoderShape, attention: str | None, device: str) -> bool:
    """Whether the attention kernel stores no probabilities. Off CUDA, sdpa with dropout in training
    runs torch's math path, which saves what eager attention saves."""
    fused = (attention or shape.attention or "sdpa") in FUSED_ATTENTION
    return fused and not (shape.attention_dropout and device != "cuda")


def _shared_inputs(shape: DecoderShape, s: int, b: int, e: int, fused: bool) -> float:
    """Inputs every layer receives that need no gradient: the eager (b, 1, s, s) mask, rotary tables."""
    rotary = 2 * s * shape.head_dim * e if shape.rotary else 0
    return (0 if fused else b * s * s * e) + rotary


def decoder_head_bytes(shape: DecoderShape, seq_len: int, batch_size: int, *, dtype: str | int = "bf16",
                       device: str = "cuda") -> float:
    """Bytes saved outside the layers: ids and labels (int64), learned position ids or the rotary
    cos / sin tables (one (s, d) pair, in the dtype), the final norm,
    the fp32 log-softmax of the logits (4*sb*V), the loss, the embedding dropout mask."""
    e, sb = _dtype_bytes(dtype), seq_len * batch_size
    mask = 1 if device == "cuda" else e
    positions = 2 * seq_len * shape.head_dim * e if shape.rotary else 8 * seq_len  # cos / sin, or position ids
    dropout = mask * sb * shape.hidden_size if shape.embedding_dropout else 0
    return 16 * sb + positions + _norm_bytes(shape, sb, e) + 4 * sb * shape.vocab_size + 4 + dropout


def decoder_activation_bytes(shape: DecoderShape, seq_len: int, batch_size: int, *, dtype: str | int = "bf16",
                             attention: str | None = None, checkpointing: bool = False, tp: int = 1,
                             partition: bool = False, cpu: bool = False,
                             device: str = "cuda", sp: int = 1, mlp_tiles: int = 1,
                             loss_tiles: int = 1) -> DecoderActivationEstimate:
    """ESTIMATE of one micro-batch's activation bytes per device (see [Note: decoder activation model]).

    Args:
        shape: ``DecoderShape.from_hf_config(config)``.
        seq_len, batch_size: tokens per sequence and sequences per device (per data-parallel replica).
        dtype: the activations' dtype ("fp32", "bf16", "fp16", or 2 / 4 bytes).
        attention: "eager" or a fused implementation (see ``FUSED_ATTENTION``); default the config's.
        checkpointing: one activation checkpoint per layer (transformers' gradient checkpointing).
        tp: tensor-parallel degree t.
        partition: P_a: each checkpoint kept as a 1/t slice (needs checkpointing and t > 1).
        cpu: P_a+cpu: checkpoints kept in host memory (needs checkpointing).
        device: "cuda" or "cpu" (dropout masks are 1 byte on CUDA, e bytes on CPU).
        sp: sequence-parallel degree S: the figures are one rank's, holding ceil(seq_len / S) positions.
        mlp_tiles: ZeroConfig.mlp_tiles N: the MLP saves none of its intermediates (its input is the norm's
            output, counted there); one slice's (1/N of the MLP term) is rebuilt in backward (``recompute``).
        loss_tiles: ZeroConfig.loss_tiles N: the head saves no log-softmax (4*sb*V); one slice's is rebuilt
            in backward with its gradients (``loss_work``: 12/N * sb*V).

    Raises:
        EstimateError: non-positive sizes, or P_a / cpu without checkpointing, or P_a without tp > 1, or
            sp > 1 with tp > 1.
    """

    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("tp", tp), ("sp", sp),
                        ("mlp_tiles", mlp_tiles), ("loss_tiles", loss_tiles)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{name} must be a positive integer, got {value!r}")
    if (partition or cpu) and not checkpointing:
        raise EstimateError("partition_activations / cpu_checkpointing act on activation checkpoints: "
                            "enable checkpointing too")
    if partition and tp == 1:
        raise EstimateError("partition_activations (P_a) needs tp > 1: with data parallelism alone there is "
                            "nothing to partition")
    if sp > 1 and tp > 1:
        raise EstimateError("sequence parallelism (sp > 1) is not combined with tensor parallelism (tp > 1)")
    e = _dtype_bytes(dtype)
    attention = attention or shape.attention or "sdpa"
    if sp > 1 and attention == "eager":
        attention = "sdpa"  # See the note: eager runs as sdpa under SP
    fused = _fused(shape, attention, device)
    per_layer = decoder_layer_bytes(shape, seq_len, batch_size, dtype=e, attention=attention, tp=tp, device=device,
                                    sp=sp)
    local = -(-seq_len // sp)  # this rank's positions
    head = decoder_head_bytes(shape, local, batch_size, dtype=e, device=device)
    sb = local * batch_size
    mlp_slice = 0.0  # one MLP tile's working set rebuilt in backward
    loss_work = 8.0 * sb * shape.vocab_size  # the loss's backward: fp32 gradients of the log-softmax and logits
    if mlp_tiles > 1:
        mlp = _mlp_bytes(shape, sb, e, tp)
        per_layer -= mlp
        mlp_slice = mlp / mlp_tiles
    if loss_tiles > 1:
        head -= 4 * sb * shape.vocab_size - 4  # no log-softmax; the loss is a sum over slices (one scalar)
        loss_work = 12.0 * sb * shape.vocab_size / loss_tiles  # one slice's log-softmax rebuilt + those two
    if sp > 1:
        head += 8  # the loss's divisor: the whole sequences' target count (int64), saved by the division
    shared = _shared_inputs(shape, local, batch_size, e, fused)
    layers, stored, recompute = shape.num_layers * per_layer, 0.0, mlp_slice
    if checkpointing:
        elements = local * batch_size * shape.hidden_size
        one = math.ceil(elements / tp) * e if partition else elements * e
        stored, layers = shape.num_layers * one + shared, 0.0
        recompute = per_layer + mlp_slice
        head -= 2 * local * shape.head_dim * e if shape.rotary else 0  # the rotary tables are checkpoint inputs
    host = stored if cpu else 0.0
    device_ckpt = 0.0 if cpu else stored
    saved = layers + stored + head
    inputs = {"seq_len": seq_len, "batch_size": batch_size, "dtype_bytes": e, "attention": attention,
              "checkpointing": checkpointing, "tp": tp, "partition": partition, "cpu": cpu, "device": device,
              "shape": dataclasses.asdict(shape), **({"sp": sp} if sp > 1 else {}),
              **({"mlp_tiles": mlp_tiles} if mlp_tiles > 1 else {}), **({"loss_tiles": loss_tiles} if loss_tiles > 1 else {})}
    return DecoderActivationEstimate(per_layer=per_layer, layers=layers, checkpoints=device_ckpt,
                                     checkpoints_host=host, head=head, saved=saved, recompute=recompute,
                                     loss_work=loss_work, total=saved - host + recompute,
                                     peak=saved - host + max(recompute, loss_work), inputs=inputs)


# --------------------------------------------------------------------------------------------------
# Encoders and encoder-decoders
# --------------------------------------------------------------------------------------------------

# [Note: encoder activation model]
# An encoder layer (BERT, RoBERTa: post-LN; BART: post-LN; T5: pre-RMSNorm) saves the same set as the
# decoder layer above: the layer's input (saved by Q, K, V), Q, K, V, the output projection's input, two
# norms' inputs and outputs (post-LN: the second norm's output is the next layer's input, the same count),
# the MLP's two f-sized tensors (relu: one, it saves its output) and the dropout masks, so
# ``decoder_layer_bytes`` counts it. Beyond it: dropout between the MLP's activation and its projection
# (T5, BART's ``activation_dropout``) saves its mask and output; an encoder-decoder's decoder layer adds
# cross-attention (a norm, Q, K and V of the encoder output, the output projection's input, the
# probabilities) and one more dropout mask. Outside the layers, per stack: ids (and BERT's token-type ids,
# int64), the embedding norm's input and fp32 statistics, its dropout mask, the stack's last output; then
# the head: BERT's pooler (dense on the first token, whose slice keeps the whole last output, tanh, dropout)
# and the classifier's log-softmax, RoBERTa's classifier (dropout, dense, tanh, dropout on the first token:
# no slice saved), an MLM head (transform dense, activation, norm: three sbh tensors, plus the logits'
# fp32 log-softmax 4*sb*V), or an encoder-decoder's LM head (the logits' log-softmax). The eager (b, 1, s, s)
# additive mask is saved once. T5's attention is always eager. Checked on CPU in fp32 with dropout against
# the saved-tensor accounting (tests/test_activations.py): BERT classifier and MLM, BART within 0.1%,
# RoBERTa 0.5%, T5 2.6% (its final norms and the decoder output's rescaling are not counted); the main
# job (all-MiniLM-L6-v2 classifier, 2 ranks) 0.9996 of its measurement.

_NO_POOLER_TYPES = ("roberta", "xlm-roberta", "camembert", "electra", "deberta", "deberta-v2")
"""Encoders whose sequence classifier reads the first token's hidden state without a pooler."""

_ENCODER_DECODER_TYPES = ("bart", "mbart", "t5", "mt5", "pegasus", "marian", "blenderbot")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderShape(DecoderShape):
    """An encoder (BERT, RoBERTa families) or encoder-decoder (BART, T5 families); see [Note: encoder
    activation model]. The ``DecoderShape`` fields describe one encoder layer.

    Attributes:
        head: "classifier" (pooler + ``num_labels`` logits: ``...ForSequenceClassification``) or "lm"
            (logits over the vocabulary).
        num_labels: the classifier's outputs.
        num_decoder_layers: decoder layers of an encoder-decoder (each adds cross-attention), else 0.
        token_types: the embeddings add token-type embeddings (BERT), which save their ids.
        pooler: the classifier reads a pooler's output (BERT) rather than the first token through its own
            dense + tanh (RoBERTa family).
        activation_dropout: dropout between the MLP's activation and its last projection (T5; BART's
            ``activation_dropout``).
    """

    head: str = "classifier"
    num_labels: int = 2
    num_decoder_layers: int = 0
    token_types: bool = False
    pooler: bool = True
    activation_dropout: bool = False

    @classmethod
    def from_hf_config(cls, source: Any, *, head: str | None = None) -> "EncoderShape":  # type: ignore[override]
        """Read an encoder's or encoder-decoder's shape from a Hugging Face config. ``head`` defaults to
        "classifier" when the config's architectures name a sequence classifier, else "lm".

        Raises:
            EstimateError: the config lacks the sizes, or is a decoder-only model.
        """

        config = load_hf_config(source)
        if not is_encoder_config(config):
            raise EstimateError(f"{type(config).__name__} is not an encoder or encoder-decoder config")
        get = lambda *names, default=None: next(  # noqa: E731
            (getattr(config, n) for n in names if getattr(config, n, None) is not None), default)
        hidden = get("hidden_size", "d_model")
        layers = get("num_hidden_layers", "encoder_layers", "num_layers")
        heads = get("num_attention_heads", "encoder_attention_heads", "num_heads")
        if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads)):
            raise EstimateError(f"{type(config).__name__} lacks hidden size, layers or heads")
        ffn = get("intermediate_size", "encoder_ffn_dim", "d_ff", default=4 * hidden)
        head_dim = get("d_kv", default=hidden // heads)
        decoder_layers = get("decoder_layers", "num_decoder_layers", default=0) if config.is_encoder_decoder else 0
        architectures = " ".join(getattr(config, "architectures", None) or [])
        if head is None:
            head = "classifier" if "SequenceClassification" in architectures else "lm"
        t5 = config.model_type in ("t5", "mt5")
        dropout = float(get("hidden_dropout_prob", "dropout", "dropout_rate", default=0.0) or 0.0) > 0
        attn_dropout = float(get("attention_probs_dropout_prob", "attention_dropout", "dropout_rate", default=0.0) or 0.0) > 0
        activation = str(get("hidden_act", "activation_function", "dense_act_fn", default="gelu"))
        return cls(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=int(head_dim),
                   vocab_size=int(config.vocab_size), ffn_size=int(ffn), rms_norm=t5,
                   gated_mlp=bool(getattr(config, "is_gated_act", False)), activation=activation, softmax_fp32=False,
                   residual_dropout=dropout, attention_dropout=attn_dropout, embedding_dropout=dropout,
                   attention="eager" if t5 else getattr(config, "_attn_implementation", None), head=head,
                   num_labels=int(getattr(config, "num_labels", 2) or 2), num_decoder_layers=int(decoder_layers),
                   token_types=(getattr(config, "type_vocab_size", 0) or 0) > 0,
                   pooler=config.model_type not in _NO_POOLER_TYPES,
                   activation_dropout=float(get("activation_dropout", "dropout_rate", default=0.0) or 0.0) > 0)


def is_encoder_config(config: Any) -> bool:
    """True for encoder-decoder configs and bidirectional encoders (no causal LM: BERT, RoBERTa, ...)."""
    if getattr(config, "is_encoder_decoder", False) or config.model_type in _ENCODER_DECODER_TYPES:
        return True
    return bool(getattr(config, "type_vocab_size", None)) or config.model_type in (
        "bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2", "albert", "mpnet")


def encoder_head_bytes(shape: EncoderShape, seq_len: int, batch_size: int, *, dtype: str | int = "bf16",
                       device: str = "cuda") -> float:
    """Bytes saved outside the layers of an encoder or encoder-decoder (see [Note: encoder activation
    model]): per stack (the encoder; the decoder too for an encoder-decoder) the ids (and token-type ids),
    the embedding norm's input and statistics, its dropout mask, and the stack's last output (saved by
    whatever reads it); then the head: "classifier" the pooler's tanh output, its dropout and the
    log-softmax and labels; "lm" (an encoder's MLM head) the transform's dense output, its norm's input
    and output, the fp32 log-softmax of the logits (4*sb*V) and the labels; an encoder-decoder's LM head
    the log-softmax of the logits and the labels."""
    e, sb, h = _dtype_bytes(dtype), seq_len * batch_size, shape.hidden_size
    mask = 1 if device == "cuda" else e
    b = batch_size
    stack = 8 * sb + e * sb * h + 2 * 4 * sb + (mask * sb * h if shape.embedding_dropout else 0) + e * sb * h
    if shape.num_decoder_layers:
        return 2 * stack + 4 * sb * shape.vocab_size + 8 * sb
    stack += 8 * sb if shape.token_types else 0
    if shape.head == "classifier":
        drop = (mask + e) * b * h if shape.residual_dropout else 0
        if not shape.pooler:  # dropout, dense, tanh, dropout, projection on the first token: no slice saved
            return stack - e * sb * h + 2 * drop + e * b * h + 4 * b * shape.num_labels + 8 * b
        return stack + e * b * h + drop + 4 * b * shape.num_labels + 8 * b
    return stack + 3 * e * sb * h + 2 * 4 * sb + 4 * sb * shape.vocab_size + 8 * sb


def _cross_attention_bytes(shape: EncoderShape, s: int, b: int, e: int, fused: bool, mask: int, tp: int) -> float:
    """One decoder layer's cross-attention over an encoder output of the same length: its norm, then Q,
    K and V (projections of the encoder output), the output projection's input and the probabilities."""
    return _norm_bytes(shape, s * b, e) + _attention_bytes(shape, s, b, e, fused, mask, tp)


def encoder_activation_bytes(shape: EncoderShape, seq_len: int, batch_size: int, *, dtype: str | int = "bf16",
                             attention: str | None = None, checkpointing: bool = False, tp: int = 1,
                             cpu: bool = False, device: str = "cuda") -> DecoderActivationEstimate:
    """ESTIMATE of one micro-batch's activation bytes for an encoder or encoder-decoder (see [Note: encoder
    activation model]); arguments as ``decoder_activation_bytes`` (no P_a). An encoder-decoder's decoder
    runs ``seq_len`` target tokens too."""

    if cpu and not checkpointing:
        raise EstimateError("cpu_checkpointing acts on activation checkpoints: enable checkpointing too")
    e = _dtype_bytes(dtype)
    attention = attention or shape.attention or "sdpa"
    fused = _fused(shape, attention, device)
    mask = 1 if device == "cuda" else e
    enc = decoder_layer_bytes(shape, seq_len, batch_size, dtype=e, attention=attention, tp=tp, device=device)
    if shape.activation_dropout:  # between the activation and the last projection: its mask and its output
        enc += (mask + e) * seq_len * batch_size * shape.ffn_size / tp
    dec = (enc + _cross_attention_bytes(shape, seq_len, batch_size, e, fused, mask, tp)
           + (mask * seq_len * batch_size * shape.hidden_size if shape.residual_dropout else 0))
    per_layer = max(enc, dec) if shape.num_decoder_layers else enc
    layers = shape.num_layers * enc + shape.num_decoder_layers * dec
    # the additive (b, 1, s, s) mask every eager / math-path layer receives
    shared = 0 if fused else batch_size * seq_len * seq_len * e
    head = encoder_head_bytes(shape, seq_len, batch_size, dtype=e, device=device)
    stored, recompute = 0.0, 0.0
    if checkpointing:
        stored = (shape.num_layers + shape.num_decoder_layers) * e * seq_len * batch_size * shape.hidden_size + shared
        layers, recompute = 0.0, per_layer
    else:
        layers += shared
    host = stored if cpu else 0.0
    saved = layers + stored + head
    inputs = {"seq_len": seq_len, "batch_size": batch_size, "dtype_bytes": e, "attention": attention,
              "checkpointing": checkpointing, "tp": tp, "partition": False, "cpu": cpu, "device": device,
              "model": "encoder-decoder" if shape.num_decoder_layers else "encoder", "shape": dataclasses.asdict(shape)}
    return DecoderActivationEstimate(per_layer=per_layer, layers=layers, checkpoints=stored - host,
                                     checkpoints_host=host, head=head, saved=saved, recompute=recompute,
                                     loss_work=0.0, total=saved - host + recompute,
                                     peak=saved - host + recompute, inputs=inputs)
