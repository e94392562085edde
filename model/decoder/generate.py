"""The reference single-request generation loop: prefill the prompt, then decode one token a step.

It uses the same paged forward pass as the engine, with a trivially allocated block table
(blocks 1..n for the one sequence), so it doubles as the exactness reference for the
batched engine. Its two jitted steps are its own, on the jnp path, and share nothing with
the engine's programs but ``model.decoder.forward.forward``: no buckets, kernels or batched sampling
of the code it checks.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.forward import forward
from raylm.model.decoder.kv_pool import DEFAULT_BLOCK_SIZE, KVCache
from raylm.model.decoder.params import ModelParams
from raylm.model.decoder.sampling import SimpleSampling, sample_token
from raylm.model.runtime.buckets import cdiv, next_power_of_two
from raylm.model.runtime.sharding import make_mesh, shard_params
from raylm.model.text.prompt_checks import check_prompt

MIN_PREFILL_BUCKET = 16


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("kv",))
def _prompt_step(
    params: ModelParams, kv: KVCache, tokens: jax.Array, positions: jax.Array, block_tables: jax.Array,
    context_lens: jax.Array, *, config: ModelConfig, all_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """The whole prompt ``tokens [1, S]`` -> last-token logits ``[1, V]`` (every token's with ``all_logits``)."""
    return forward(params, config, tokens, positions, kv, block_tables, context_lens, all_logits)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("kv",))
def _token_step(
    params: ModelParams, kv: KVCache, token: jax.Array, position: jax.Array, block_tables: jax.Array,
    context_lens: jax.Array, *, config: ModelConfig,
) -> tuple[jax.Array, KVCache]:
    """One token ``[1]`` at ``position [1]`` -> logits ``[1, V]``."""
    return forward(params, config, token[:, None], position[:, None], kv, block_tables, context_lens)


class SingleSequenceGenerator:
    """Greedy or sampled generation for one sequence at a time, optionally tensor-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        params: ModelParams,
        mesh: Mesh | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_dtype: jnp.dtype | None = None,
    ):
        self.config = config
        self.mesh = mesh or make_mesh(1)
        self.params = shard_params(params, config, self.mesh)
        self.block_size = block_size
        self.kv_dtype = kv_dtype or params.final_norm.dtype  # the model dtype (norms are never quantized)

    def _new_kv(self, num_blocks: int) -> KVCache:
        return KVCache.create(self.config, num_blocks, self.block_size, self.kv_dtype, self.mesh)

    def _check(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        config = self.config
        check_prompt(prompt_ids, config.vocab_size, max_tokens, config.max_position_embeddings)

    def prompt_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """float32 logits ``[len(prompt), V]`` for every prompt position (for reference checks)."""
        n = len(prompt_ids)
        self._check(prompt_ids, 0)
        width = next_power_of_two(cdiv(n, self.block_size))
        tokens, positions = self._padded_prompt(prompt_ids)
        logits, _ = _prompt_step(
            self.params, self._new_kv(width + 1), tokens, positions,
            jnp.arange(1, width + 1, dtype=jnp.int32)[None], jnp.array([n], jnp.int32),
            config=self.config, all_logits=True,
        )
        return np.asarray(logits[0, :n])

    def _padded_prompt(self, prompt_ids: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        n = len(prompt_ids)
        bucket = max(MIN_PREFILL_BUCKET, next_power_of_two(n))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = prompt_ids
        return jnp.asarray(tokens), jnp.arange(bucket, dtype=jnp.int32)[None]

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: SimpleSampling = SimpleSampling(temperature=0.0),
        stop_token_ids: Sequence[int] = (),
    ) -> Iterator[int]:
        """Yield up to ``max_tokens`` new ids, stopping after any of ``stop_token_ids``."""
        n = len(prompt_ids)
        self._check(prompt_ids, max_tokens)
        if max_tokens <= 0:
            return
        width = next_power_of_two(cdiv(n + max_tokens, self.block_size))
        kv = self._new_kv(width + 1)
        block_table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]
        tokens, positions = self._padded_prompt(prompt_ids)
        logits, kv = _prompt_step(
            self.params, kv, tokens, positions, block_table, jnp.array([n], jnp.int32), config=self.config
        )
        key = jax.random.key(sampling.seed if sampling.seed is not None else np.random.randint(2**31))
        stops = set(stop_token_ids)
        for step in range(max_tokens):
            if sampling.greedy:
                token = int(jnp.argmax(logits[0]))
            else:
                key, sub = jax.random.split(key)
                token = int(sample_token(
                    logits[0], sub, jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
                    jnp.float32(sampling.top_p),
                ))
            yield token
            if token in stops or step == max_tokens - 1:
                return
            position = n + step
            logits, kv = _token_step(
                self.params, kv, jnp.array([token], jnp.int32), jnp.array([position], jnp.int32),
                block_table, jnp.array([position + 1], jnp.int32), config=self.config,
            )
