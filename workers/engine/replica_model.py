"""The model a replica serves, loaded onto the replica's mesh (one process's share under
``jax.distributed``): every way a replica or one host's process of it starts loads through here."""

from __future__ import annotations

from jax.sharding import Mesh

from raylm.model.loaders.load import LoadedModel, load_model
from raylm.model.runtime.sharding import make_mesh
from raylm.workers.engine.engine_args import EngineArgs


def replica_mesh(args: EngineArgs) -> Mesh | None:
    """The mesh the weights are placed on as they load: the replica's tensor x expert mesh where
    it spans several devices (under ``jax.distributed``, several hosts), so that no process holds
    the whole model unsharded; None on one device and for pipeline stages (each loads its layers)."""
    if args.num_devices == 1 or args.pipeline_parallel_size > 1:
        return None
    return make_mesh(args.tensor_parallel_size, ep=args.expert_parallel_size)


def packed_at_load(args: EngineArgs) -> str:
    """The integer mode's packing the load applies (``load_model``'s ``activation_quantization``):
    ``args``' own, except where a draft is cut from the target's layers (``speculative.method:
    draft`` without a model of its own), since a draft keeps its exact sums; the engine then packs
    the target alone after the draft is cut (``LLMEngine``)."""
    spec = args.speculative
    cut_draft = spec is not None and spec.method == "draft" and spec.model is None
    return "none" if cut_draft else args.activation_quantization


def load_replica_model(model: str, args: EngineArgs, layers: range | None = None) -> LoadedModel:
    """``model`` (a name or path) loaded as ``args`` say: dtype, quantization, GGUF blocks kept or
    expanded, packed for the integer mode (``packed_at_load``), and placed on ``replica_mesh``;
    ``layers``: a pipeline stage's alone."""
    return load_model(model, args.dtype, args.quantization, args.keep_gguf_blocks(), layers=layers,
                      mesh=replica_mesh(args), activation_quantization=packed_at_load(args))
