"""KV offload through the engine: blocks loaded from a tier instead of computed give the tokens
the single-sequence reference computes, whatever the tier brings (all, part, nothing), and a
request that ends while loading leaks no block; a model whose sliding layers keep a KV group of
its own (Gemma 2) loads each group's blocks."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.cache.block_hash import block_hashes
from raylm.cache.offload.connector import KVConnector
from raylm.cache.offload.host_tier import HostTier
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_model
from raylm.workers.core.kv_loads import KVLoads
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.kv_offload_setup import weights_fingerprint
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
HOST = {"host_bytes": 256 << 20}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("offload") / "m")
    return load_model(path)


@pytest.fixture(scope="module")
def workload(tiny):
    """20 prompts of 1..200 tokens, half of them sharing a 70-token prefix, and their greedy
    continuations from the single-sequence reference."""
    rng = np.random.RandomState(1)
    shared = rng.randint(3, 320, size=70).tolist()
    lengths = [1, 15, 16, 17, 33, 200] + rng.randint(1, 201, size=14).tolist()
    prompts = [(shared if i % 2 else []) + rng.randint(3, 320, size=n).tolist() for i, n in enumerate(lengths)]
    reference = SingleSequenceGenerator(tiny.config, tiny.params)
    return prompts, [list(reference.generate(p, NEW_TOKENS)) for p in prompts]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _loadable_tokens(prompts: list[list[int]], block_size: int = 16) -> int:
    """Prompt tokens in full blocks before each prompt's last token: what a load can bring."""
    return sum((len(p) - 1) // block_size * block_size for p in prompts)


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == stats.waiting == stats.loading == 0


def _swap_tier(llm: LLM, tier) -> None:
    """Serve ``llm``'s loads and publishes from ``tier`` alone (a test double around a real tier)."""
    engine = llm.engine
    engine.kv_connector.close()
    engine.kv_connector = KVConnector([tier], engine.kv_connector.space,
                                      *(layout.nbytes for layout in engine.pool_blocks.layouts))
    engine.scheduler.loads = KVLoads(engine.kv_connector, engine.blocks)


@pytest.mark.parametrize("settings", [
    pytest.param({}, id="default"),
    pytest.param({"max_num_batched_tokens": 32, "max_num_seqs": 4}, id="small-steps"),
    pytest.param({"kv_cache_dtype": "int8"}, id="int8-kv"),
    pytest.param({"tensor_parallel_size": 2}, id="tensor-parallel-2"),
])
def test_prefixes_evicted_from_the_pool_load_from_the_host_tier(tiny, workload, settings):
    prompts, expected = workload
    llm = LLM(tiny, kv_offload=HOST, **settings)
    plain = LLM(tiny, **settings) if settings.get("kv_cache_dtype") else None  # 8-bit K/V: its own reference
    if plain is not None:
        expected = _run(plain, prompts)
    assert _run(llm, prompts) == expected
    first = llm.engine.stats()
    llm.engine.pool.reset_prefix_cache()  # nothing cached in the pool: every prefix comes from the tier
    assert _run(llm, prompts) == expected
    stats = llm.engine.stats()
    # Each prompt's full blocks came from the tier, or from the pool where another prompt of the
    # run had loaded them (the shared prefix is loaded once).
    loaded = llm.engine.scheduler.loads.num_loaded_tokens
    assert loaded + stats.pool.prefix_hits - first.pool.prefix_hits == _loadable_tokens(prompts)
    assert loaded >= _loadable_tokens(prompts) - 4 * 16 * (len(prompts) - 1)
    # (a prompt left with one token to compute runs it as a decode, outside the prompt count)
    assert stats.prompt_tokens - first.prompt_tokens <= sum(map(len, prompts)) - _loadable_tokens(prompts)
    assert stats.kv_offload_loaded_tokens == loaded and stats.kv_offload_queried_tokens >= loaded
    (host,) = stats.kv_offload
    assert host.tier == "host" and host.hits == loaded // 16 and host.misses == 0
    _assert_no_leak(llm)


def test_preempted_and_overflowing_conversations_reload(tiny, workload):
    """A pool far smaller than the live context: sequences are preempted and re-admitted, their
    prefixes evicted; with the host tier they come back by loading, with the same tokens."""
    prompts, expected = workload
    llm = LLM(tiny, kv_offload=HOST, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=64)
    assert _run(llm, prompts * 2) == expected * 2
    assert llm.engine.scheduler.loads.num_loaded_tokens > 0
    _assert_no_leak(llm)


class _Flaky:
    """A host tier that has lost about a third of its blocks (lost objects, corrupt files): it
    still lists them, but reading one gives nothing."""

    name = "host"

    def __init__(self, tier: HostTier):
        self.tier, self.calls = tier, 0

    def contains(self, keys):
        return self.tier.contains(keys)

    def get(self, keys):
        found = self.tier.get(keys)
        return [None if key[0] % 3 == 0 else payload for key, payload in zip(keys, found)]

    def put(self, items):
        self.tier.put(items)

    def stats(self):
        return self.tier.stats()

    def close(self):
        self.tier.close()


def test_a_load_that_brings_part_of_the_blocks_computes_the_rest(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, kv_offload=HOST)
    _swap_tier(llm, _Flaky(HostTier(256 << 20)))
    assert _run(llm, prompts) == expected
    llm.engine.pool.reset_prefix_cache()
    assert _run(llm, prompts) == expected
    loaded = llm.engine.scheduler.loads.num_loaded_tokens
    assert 0 < loaded < _loadable_tokens(prompts)
    _assert_no_leak(llm)


class _Held(_Flaky):
    """A host tier whose reads wait until the test lets them go."""

    def __init__(self, tier: HostTier):
        super().__init__(tier)
        self.release = threading.Event()

    def get(self, keys):
        self.release.wait(30)
        return self.tier.get(keys)


def test_a_request_aborted_while_loading_leaks_no_block(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, kv_offload=HOST)
    held = _Held(HostTier(256 << 20))
    _swap_tier(llm, held)
    long_prompt = max(prompts, key=len)
    _run(llm, [long_prompt])
    llm.engine.pool.reset_prefix_cache()
    engine = llm.engine
    engine.add_request("r", long_prompt, GREEDY)
    engine.step()
    assert engine.stats().loading == 1 and engine.pool.num_used_blocks > 0
    engine.abort("r")
    held.release.set()
    engine.kv_connector.flush(10)
    for _ in range(3):
        engine.step()
    assert engine.kv_connector.loads_in_flight == 0
    _assert_no_leak(llm)
    held.release.set()
    assert _run(llm, prompts[:4]) == expected[:4]


def test_speculative_draft_pools_travel_with_the_blocks(tiny, workload):
    prompts, expected = workload
    llm = LLM(tiny, kv_offload=HOST,
              speculative=dict(method="draft", num_layers=1, num_speculative_tokens=2))
    assert _run(llm, prompts) == expected
    hits = llm.engine.stats().pool.prefix_hits
    llm.engine.pool.reset_prefix_cache()
    assert _run(llm, prompts) == expected
    loaded = llm.engine.scheduler.loads.num_loaded_tokens
    assert loaded + llm.engine.stats().pool.prefix_hits - hits == _loadable_tokens(prompts)


def test_the_weights_fingerprint_tells_checkpoints_apart(tiny, tmp_path):
    same = load_model(build_tiny_checkpoint("llama-gqa", tmp_path / "same")[0])
    other = load_model(build_tiny_checkpoint("llama-gqa", tmp_path / "other", seed=1)[0])
    assert weights_fingerprint(tiny.params) == weights_fingerprint(same.params)
    assert weights_fingerprint(tiny.params) != weights_fingerprint(other.params)


# A model whose sliding layers keep a KV group of their own (the tiny "gemma2": a 16-token
# window), in blocks of 8 tokens: a load's end needs 2-3 sliding blocks.
TWO_GROUPS = {"block_size": 8, "max_num_batched_tokens": 32, "max_model_len": 256}


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    """(model, prompts of 1..100 tokens, two more on a shared 45-token prefix, and the greedy
    tokens of the engine without offload)."""
    rng = np.random.RandomState(7)
    shared = rng.randint(3, 320, size=45).tolist()
    prompts = [(shared if i % 2 else []) + rng.randint(3, 320, size=n).tolist() for i, n in enumerate([1, 40, 100, 17])]
    model = load_model(build_tiny_checkpoint("gemma2", tmp_path_factory.mktemp("gemma2") / "m")[0])
    return model, prompts, _run(LLM(model, **TWO_GROUPS), prompts)


def _empty_pools(llm: LLM) -> None:
    """Forget every cached block of both groups and zero the pools: a block not loaded (or
    loaded wrong) cannot pass for one that was."""
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    engine.blocks.sliding.reset_prefix_cache()
    engine.runner.kv = jax.tree.map(jnp.zeros_like, engine.runner.kv)


def _assert_no_leak_in_either_group(llm: LLM) -> None:
    _assert_no_leak(llm)
    assert llm.engine.blocks.sliding.num_used_blocks == 0


def test_a_model_with_two_kv_groups_loads_each_groups_blocks(two_groups):
    model, prompts, expected = two_groups
    llm = LLM(model, kv_offload=HOST, **TWO_GROUPS)
    assert _run(llm, prompts) == expected
    _empty_pools(llm)
    hits = llm.engine.stats().pool.prefix_hits
    assert _run(llm, prompts) == expected
    loaded = llm.engine.scheduler.loads.num_loaded_tokens
    # Every prompt's full blocks came from the tier (or from the pool, where another prompt
    # loaded them); of the sliding group's, only the 2-3 each load's end reads.
    assert loaded + llm.engine.stats().pool.prefix_hits - hits == _loadable_tokens(prompts, 8)
    assert loaded >= _loadable_tokens(prompts, 8) - 6 * 8 * (len(prompts) - 1)
    (host,) = llm.engine.stats().kv_offload
    sliding_read = host.hits - loaded // 8
    assert 0 < sliding_read <= 3 * len(prompts) and host.misses == 0
    _assert_no_leak_in_either_group(llm)


def test_a_two_group_load_that_brings_part_of_the_blocks_computes_the_rest(two_groups):
    """A tier that lost a third of both groups' blocks (it reads them and gets nothing): a load
    ends before any block whose end's sliding blocks did not arrive, here mostly bringing
    nothing; the tokens stay the same."""
    model, prompts, expected = two_groups
    llm = LLM(model, kv_offload=HOST, **TWO_GROUPS)
    _swap_tier(llm, _Flaky(HostTier(256 << 20)))
    assert _run(llm, prompts) == expected
    _empty_pools(llm)
    assert _run(llm, prompts) == expected
    (host,) = llm.engine.stats().kv_offload
    assert host.hits > 0 and llm.engine.scheduler.loads.num_loaded_tokens < _loadable_tokens(prompts, 8)
    _assert_no_leak_in_either_group(llm)


def test_a_restarted_two_group_replica_loads_from_the_disk_tier(two_groups, tmp_path):
    model, prompts, expected = two_groups
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes": 64 << 20}
    first = LLM(model, kv_offload=disk, **TWO_GROUPS)
    assert _run(first, prompts) == expected
    first.engine.flush_kv_publish(30)
    first.engine.close()
    restarted = LLM(model, kv_offload=disk, **TWO_GROUPS)
    assert _run(restarted, prompts) == expected
    assert restarted.engine.scheduler.loads.num_loaded_tokens >= _loadable_tokens(prompts, 8) // 2
    _assert_no_leak_in_either_group(restarted)


def test_offload_settings_are_checked():
    from raylm.workers.engine.engine_args import EngineArgs

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(kv_offload=HOST, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(kv_offload={"host": 5})
    assert EngineArgs(kv_offload={"host_bytes": 0}).kv_offload is None


def test_a_restarted_replica_loads_from_the_disk_tier(tiny, workload, tmp_path):
    prompts, expected = workload
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes": 256 << 20}
    first = LLM(tiny, kv_offload=disk)
    assert _run(first, prompts) == expected
    first.engine.flush_kv_publish(30)
    first.engine.close()
    restarted = LLM(tiny, kv_offload=disk)
    assert _run(restarted, prompts) == expected
    loaded = restarted.engine.scheduler.loads.num_loaded_tokens
    assert loaded >= _loadable_tokens(prompts) - 4 * 16 * (len(prompts) - 1)
    # Every block file corrupted: the next replica computes those blocks (it may still load the
    # ones it publishes itself during the run), with the same tokens.
    restarted.engine.close()
    for path in (tmp_path / "kv").rglob("*.kvb"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10
        path.write_bytes(bytes(data))
    corrupted = LLM(tiny, kv_offload=disk)
    assert _run(corrupted, prompts) == expected
    (tier,) = corrupted.engine.stats().kv_offload
    assert tier.errors.get("corrupt", 0) > 0 and tier.hits * 16 == corrupted.engine.scheduler.loads.num_loaded_tokens
    _assert_no_leak(corrupted)


def test_a_replica_loads_what_another_computed_through_the_cluster_tier(tiny, workload, serve_cluster):
    prompts, expected = workload
    cluster = {"cluster_bytes": 128 << 20, "host_bytes": 64 << 20}
    with LLM(tiny, kv_offload=cluster) as a, LLM(tiny, kv_offload=cluster) as b:
        assert _run(a, prompts) == expected
        a.engine.flush_kv_publish(30)
        b.engine.refresh_kv_tiers(30)
        assert _run(b, prompts) == expected
        assert b.engine.stats().prompt_tokens < a.engine.stats().prompt_tokens
        tiers = {t.tier: t for t in b.engine.stats().kv_offload}
        assert tiers["cluster"].hits > 0 and tiers["host"].stored > 0
        _assert_no_leak(b)
        # What each tells routers the cluster tier holds: every full block of every prompt.
        full_blocks = {h for p in prompts for h in block_hashes(p[:len(p) - 1], 16, a.engine.blocks.salt)}
        assert set(a.engine.kv_connector.shared_hashes(10**6)) >= full_blocks
        assert set(b.engine.kv_connector.shared_hashes(10**6)) & full_blocks


def test_every_tier_on_and_each_in_turn_the_one_loads_come_from(tiny, workload, tmp_path, serve_cluster):
    """Host, disk and cluster tiers at once; the pool emptied, then the nearer tiers emptied one
    by one, so the prefixes come from the host tier, then the disk, then the cluster."""
    prompts, expected = workload
    tiers_on = {"host_bytes": 64 << 20, "disk_path": str(tmp_path / "kv"), "disk_bytes": 64 << 20,
                "cluster_bytes": 128 << 20}
    with LLM(tiny, kv_offload=tiers_on) as llm:
        assert _run(llm, prompts) == expected
        llm.engine.flush_kv_publish(30)
        tiers = {tier.name: tier for tier in llm.engine.kv_connector.tiers}

        def hits() -> dict[str, int]:
            return {stats.tier: stats.hits for stats in llm.engine.stats().kv_offload}

        order = ("host", "disk", "cluster")
        for source in order:
            if source != "host":
                tiers["host"].close()  # emptied
            if source == "cluster":
                for path in (tmp_path / "kv").rglob("*.kvb"):
                    path.unlink()  # the disk tier still lists them: its reads miss, and the cluster's follow
            before = hits()
            llm.engine.pool.reset_prefix_cache()
            assert _run(llm, prompts) == expected, source
            gained = {tier: n - before[tier] for tier, n in hits().items()}
            # Farther tiers are not asked; nearer emptied ones serve only what this round put back
            # into them (a block loaded from afar is kept in the host tier for the next prompt).
            farther = order[order.index(source) + 1:]
            assert gained[source] > 0 and all(gained[tier] == 0 for tier in farther), (source, gained)
            if source == "cluster":
                assert gained["disk"] == 0
            llm.engine.flush_kv_publish(30)
        _assert_no_leak(llm)


def test_prompts_sharing_a_prefix_load_it_once(tiny):
    """16 prompts on one 160-token prefix that only the tier holds: one of them loads its 10
    blocks, the others wait for that load and find them in the pool."""
    rng = np.random.RandomState(3)
    prefix = rng.randint(3, 320, size=160).tolist()
    prompts = [prefix + rng.randint(3, 320, size=5).tolist() for _ in range(16)]
    reference = SingleSequenceGenerator(tiny.config, tiny.params)
    llm = LLM(tiny, kv_offload=HOST)
    assert _run(llm, prompts[:1]) == [list(reference.generate(prompts[0], NEW_TOKENS))]
    llm.engine.pool.reset_prefix_cache()
    hits_before = llm.engine.stats().kv_offload[0].hits
    assert _run(llm, prompts) == [list(reference.generate(p, NEW_TOKENS)) for p in prompts]
    assert llm.engine.stats().kv_offload[0].hits - hits_before == 10
    assert llm.engine.scheduler.loads.num_loaded_tokens == 160
    _assert_no_leak(llm)


def test_a_load_the_pool_had_too_few_blocks_for_resumes_instead_of_computing(tiny):
    """A 330-token prompt whose 20 loadable blocks only the tier holds arrives beside a
    150-token one that takes 10 of the pool's 25 blocks: its load stops at the 15 free ones. When
    the other request ends, the rest of its blocks are loaded too, not computed; its cached
    tokens count each block once."""
    rng = np.random.RandomState(4)
    long, short = rng.randint(3, 320, size=330).tolist(), rng.randint(3, 320, size=150).tolist()
    reference = SingleSequenceGenerator(tiny.config, tiny.params)
    llm = LLM(tiny, kv_offload=HOST, num_kv_blocks=26)  # 25 and the reserved null block
    assert _run(llm, [long]) == [list(reference.generate(long, NEW_TOKENS))]
    llm.engine.pool.reset_prefix_cache()
    before = llm.engine.stats()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], [one, GREEDY])
    assert [o.outputs[0].token_ids for o in outputs] == [list(reference.generate(short, 1)),
                                                         list(reference.generate(long, NEW_TOKENS))]
    assert llm.engine.scheduler.loads.num_loaded_tokens == 20 * 16
    assert llm.engine.stats().prompt_tokens - before.prompt_tokens == len(short) + len(long) - 20 * 16
    assert outputs[1].num_cached_tokens == 20 * 16
    _assert_no_leak(llm)


def test_a_two_group_load_the_pool_had_too_few_blocks_for_resumes(two_groups):
    """The same with two KV groups (blocks of 8): a 200-token prompt's 24 loadable blocks, of
    which the pool has 20 free beside an 80-token prompt's 10; the resumed load brings the rest
    and the sliding blocks its new end's window reads."""
    model, _, _ = two_groups
    rng = np.random.RandomState(5)
    long, short = rng.randint(3, 320, size=200).tolist(), rng.randint(3, 320, size=80).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    plain = LLM(model, **TWO_GROUPS)
    expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": short},
                                                                {"prompt_token_ids": long}], [one, GREEDY])]
    llm = LLM(model, kv_offload=HOST, num_kv_blocks=31, **TWO_GROUPS)
    assert _run(llm, [long]) == expected[1:]
    _empty_pools(llm)
    before = llm.engine.stats()
    outputs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], [one, GREEDY])
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.loads.num_loaded_tokens == 24 * 8
    assert llm.engine.stats().prompt_tokens - before.prompt_tokens == len(short) + len(long) - 24 * 8
    assert outputs[1].num_cached_tokens == 24 * 8
    _assert_no_leak_in_either_group(llm)
