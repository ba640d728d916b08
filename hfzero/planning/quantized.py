"""Bytes per rank per step, total and inter-node, with ZeRO++'s quantized collectives (qwZ, qgZ) and hpZ.

``estimate.node_comm_elements_per_step`` counts elements; quantization changes what one element costs, so this
module counts bytes, term by term, with the node split of [Note: node traffic] in hfzero/comm/collectives.py and the packed
sizes of [Note: block quantization] in hfzero/comm/codec.py:

- reductions (R = 1 under "local" accumulation, A per step under "sharded"): unquantized, a reduce-scatter of Ψ
  elements over the shard group (its ring's crossing share inter-node); qgZ, per [Note: quantized collectives],
  an all-to-all of Ψ quantized values inside the node (none crosses) and one of Ψ / L across it (all cross), L the
  shard group's ranks per node;
- gathers: stages 1-2 one post-step gather of Ψ; stage 3 a forward and a backward gather of Ψ - P per micro-batch
  and one of the P persistent parameters after the step. qwZ packs every one of them (Ψ int8 codes plus 4 bytes
  per block) except hpZ's backward gathers, which stay unquantized and inside the node;
- HSDP: the replicate all-reduce of the gradient shard (2Ψ / G, gradient bytes), unquantized.

Packed sizes are taken per element (bits / 8 + 4 / block), i.e. without the padding of each chunk to whole
blocks: the measured bytes exceed this by at most one block's codes per chunk and collective (well under 2% for
chunks of thousands of elements). ``layout_*`` give the exact per-bucket counts.
"""

from __future__ import annotations

from hfzero.planning.estimate import EstimateError, comm_elements_per_step, resolve_accumulation
from hfzero.comm.codec import BITS, packed_row_bytes
from hfzero.comm.topology import ring_crossings


def packed_bytes_per_element(name: str | None, block: int, plain_bytes: float) -> float:
    """Bytes one element costs on the wire: ``plain_bytes`` unquantized, else codes plus the block's scale."""
    if name is None:
        return plain_bytes
    if name not in BITS:
        raise EstimateError(f"quantization must be int8 or int4, got {name!r}")
    if block < 1:
        raise EstimateError(f"the quantization block must be at least 1, got {block}")
    return BITS[name] / 8 + 4 / block


def node_comm_bytes_per_step(num_params: float, dp: int, stage: int, *, nodes: int = 1, shard_size: int = 0,
                             accumulation_steps: int = 1, accumulation: str = "auto", persistent_params: float = 0,
                             secondary_partition: bool = False, param_bytes: float = 2, grad_bytes: float = 2,
                             quantize_weights: str | None = None, quantize_gradients: str | None = None,
                             quantize_block: int = 256) -> tuple[float, float]:
    """(total, inter-node) bytes per rank per step, clipping aside; the terms are in the module docstring."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or dp % nodes:
        raise EstimateError(f"nodes must be a positive integer dividing dp={dp}, got {nodes!r}")
    shard = shard_size or dp
    if shard < 1 or dp % shard:
        raise EstimateError(f"shard_size must be a positive integer dividing dp={dp}, got {shard_size!r}")
    if stage == 0 and (quantize_weights or quantize_gradients):
        raise EstimateError("quantized collectives replace ZeRO's gathers and reduce-scatters: stages 1-3")
    comm_elements_per_step(num_params, shard, stage, accumulation_steps=accumulation_steps,
                           accumulation=accumulation, persistent_params=persistent_params)  # validates
    if dp == 1:
        return 0.0, 0.0
    per_node = dp // nodes
    cross = ring_crossings(range(shard), per_node) / shard if shard > 1 else 0.0
    reductions = 1 if resolve_accumulation(stage, accumulation) == "local" else accumulation_steps
    total = inter = 0.0
    if shard > 1:
        if stage == 0:
            total += 2 * num_params * reductions * grad_bytes
            inter += 2 * num_params * reductions * grad_bytes * cross
        elif quantize_gradients:
            local = min(per_node, shard)  # the shard group's ranks per node (shard groups are consecutive ranks)
            wire = packed_bytes_per_element(quantize_gradients, quantize_block, grad_bytes)
            intra_hop = num_params * wire if local > 1 else 0.0
            inter_hop = num_params / local * wire if shard > local else 0.0
            total += (intra_hop + inter_hop) * reductions
            inter += inter_hop * reductions
        else:
            total += num_params * reductions * grad_bytes
            inter += num_params * reductions * grad_bytes * cross
        wire = packed_bytes_per_element(quantize_weights, quantize_block, param_bytes)
        if stage in (1, 2):
            total += num_params * wire
            inter += num_params * wire * cross
        elif stage == 3:
            partitioned = (num_params - persistent_params) * accumulation_steps
            forward = partitioned * wire + persistent_params * wire
            backward = partitioned * (param_bytes if secondary_partition and cross else wire)
            total += forward + backward
            inter += forward * cross + (0.0 if secondary_partition else backward * cross)
    if shard < dp and stage > 0:
        replicas = list(range(0, dp, shard))
        shard_sum = 2.0 * num_params / shard * grad_bytes
        total += shard_sum
        inter += shard_sum * ring_crossings(replicas, per_node) / len(replicas)
    return total, inter


def error_feedback_bytes(num_params: float, dp: int, *, nodes: int = 1, shard_size: int = 0) -> float:
    """qgZ error feedback's residuals per rank (QUANT_RESIDUAL, a model state: held across steps), fp32: Ψ for the
    intra-node hop when the shard group has L > 1 ranks per node, plus Ψ / L for the inter-node hop when it spans
    nodes (bucket padding aside: the engine holds them for the padded count). See [Note: quantized collectives]."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or dp % nodes:
        raise EstimateError(f"nodes must be a positive integer dividing dp={dp}, got {nodes!r}")
    shard = shard_size or dp
    if shard < 1 or dp % shard:
        raise EstimateError(f"shard_size must be a positive integer dividing dp={dp}, got {shard_size!r}")
    if shard == 1:
        return 0.0
    local = min(dp // nodes, shard)  # the shard group's ranks per node (shard groups are consecutive ranks)
    return 4.0 * ((num_params if local > 1 else 0.0) + (num_params / local if shard > local else 0.0))


def layout_gather_bytes(chunk: int, world: int, name: str | None, block: int, plain_bytes: int) -> int:
    """Exact bytes one gather of ``chunk`` elements per rank over ``world`` ranks counts (qwZ or not)."""
    if world < 2:
        return 0
    return world * (packed_row_bytes(chunk, BITS[name], block) if name else chunk * plain_bytes)


def layout_reduce_bytes(chunk: int, per_node: int, nodes: int, name: str, block: int) -> tuple[int, int]:
    """Exact (intra-node hop, inter-node hop) bytes one qgZ reduction of ``chunk`` elements per rank counts, over a
    group of ``per_node`` ranks on each of ``nodes`` nodes (See [Note: quantized collectives])."""
    bits = BITS[name]
    intra = per_node * packed_row_bytes(nodes * chunk, bits, block) if per_node > 1 else 0
    inter = nodes * packed_row_bytes(chunk, bits, block) if nodes > 1 else 0
    return intra, inter
