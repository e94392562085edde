"""Expert parallelism inside the MoE block: each device of the ``ep`` mesh axis runs its own
experts only, as a ``shard_map`` over that axis, and one all-reduce sums their outputs.

Left to XLA's partitioner, the sharded expert stacks (model/runtime/sharding.py) made every device
run ``ragged_dot`` over its shard with the routing of every pair, and XLA's CPU backend lowers
that to a dense dot over all its experts: a 2-device EP replica served ~0.12x one device's tokens.
Inside the ``shard_map`` the arrays are each device's own, so the grouped kernel
(model/kernels/grouped_matmul.py, a custom call XLA cannot partition) runs there as on one device.

With the mesh ``ep x tp`` every device sees all the step's tokens (attention is replicated over
``ep``), so no token needs to move to its experts: a device keeps the (token, k) pairs routed to
its experts, sends the others past every group (the kernel computes nothing for them, as for a
padding token), computes ``sum_k weight * expert(h)`` over its own, and a ``psum`` of ``[T, D]``
over ``ep`` adds the devices' shares. The other dispatch, an all-to-all of each token's copies to
its experts' devices and one back, moves ``top_k`` times the rows and is two collectives, each
slower than the one all-reduce at every batch size benchmarks/ep_collectives_bench.py measured
(docs/performance.md "Expert-parallel collectives"); it pays only where attention is
data-parallel, which raylm's is not.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from raylm.model.quantization.quant_array import QuantArray
from raylm.model.runtime.sharding import EP_AXIS, array_mesh

# (h [T, D], experts [T, k] with E_local for another device's, weights [T, k], valid [T] | None,
# stacks: this device's expert arrays) -> sum over k of its experts' weighted outputs [T, D].
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, "jax.Array | None", tuple[Any, ...]], jax.Array]


def experts_mesh(w_gate_up: jax.Array | QuantArray | Any) -> Mesh | AbstractMesh | None:
    """The mesh a stacked expert matrix is split over when its ``ep`` axis has more than one
    device, else None (``model.runtime.sharding.array_mesh``)."""
    return array_mesh(w_gate_up, EP_AXIS)


def over_expert_shards(
    mesh: Mesh | AbstractMesh, local_experts: LocalExperts, h: jax.Array, experts: jax.Array, weights: jax.Array,
    valid: jax.Array | None, stacks: tuple[Any, ...], num_experts: int,
) -> jax.Array:
    """``sum_k weight[t, k] * expert[t, k](h[t])`` with the stacked expert arrays ``stacks``
    (leading axis: the ``num_experts`` experts, split over ``ep``) computed by ``local_experts``
    on each device for its own experts, then summed over ``ep``. Every other input is replicated."""
    ep = mesh.shape[EP_AXIS]
    per_device = num_experts // ep

    def on_device(h: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array | None,
                  stacks: tuple[Any, ...]) -> jax.Array:
        first = jax.lax.axis_index(EP_AXIS) * per_device
        mine = (experts >= first) & (experts < first + per_device)
        local = jnp.where(mine, experts - first, per_device)  # per_device: past every local group
        return jax.lax.psum(local_experts(h, local, weights, valid, stacks), EP_AXIS)

    replicated, split = PartitionSpec(), PartitionSpec(EP_AXIS)
    return jax.shard_map(
        on_device, mesh=mesh, in_specs=(replicated, replicated, replicated, replicated, split), out_specs=replicated,
    )(h, experts, weights, valid, stacks)
