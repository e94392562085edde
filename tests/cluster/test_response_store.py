"""The response store's bounds and ownership (cluster/response_store.py), on the in-memory store
that the cluster's actor also holds: records past their age are gone, the oldest go first when
the bytes run out, a record bigger than the whole store is refused, an owner sees only its own, and a
background response's stream events grow only while it is in progress."""

from __future__ import annotations

import json

from raylm.cluster.response_store import MemoryResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(size: int) -> dict:
    return {"text": "x" * size}


def test_records_expire_by_age():
    clock = Clock()
    store = MemoryResponseStore(max_bytes=10_000, max_age_s=60, clock=clock)
    store.put("a", "old", _record(10))
    clock.now += 30
    store.put("a", "new", _record(10))
    clock.now += 31
    assert store.get("a", "old") is None and store.get("a", "new") == _record(10)
    clock.now += 30
    assert store.get("a", "new") is None and len(store) == 0 and store.bytes == 0


def test_oldest_records_are_evicted_to_fit_the_bytes():
    size = len(json.dumps(_record(100), separators=(",", ":")))
    store = MemoryResponseStore(max_bytes=3 * size, max_age_s=3600)
    for name in ("r1", "r2", "r3"):
        assert store.put("a", name, _record(100))
    assert store.put("a", "r4", _record(100))
    assert store.get("a", "r1") is None and [store.get("a", n) is not None for n in ("r2", "r3", "r4")] == [True] * 3
    assert store.bytes == 3 * size
    assert not store.put("a", "huge", _record(4 * size)) and len(store) == 3  # bigger than the store: refused


def test_replacing_a_record_counts_its_bytes_once():
    store = MemoryResponseStore(max_bytes=10_000, max_age_s=3600)
    store.put("a", "r", _record(100))
    store.put("a", "r", _record(10))
    assert len(store) == 1 and store.bytes == len(json.dumps(_record(10), separators=(",", ":")))


def test_an_owner_sees_and_deletes_only_its_own_records():
    store = MemoryResponseStore(max_bytes=10_000, max_age_s=3600)
    store.put("alice", "r", _record(1))
    assert store.get("bob", "r") is None and not store.delete("bob", "r")
    assert store.get("alice", "r") == _record(1) and store.delete("alice", "r") and store.get("alice", "r") is None


def test_replace_only_while_the_status_is_unchanged():
    store = MemoryResponseStore(max_bytes=10_000, max_age_s=3600)
    store.put("a", "r", {"response": {"status": "in_progress"}})
    assert store.replace("a", "r", {"response": {"status": "cancelled"}}, "in_progress")
    assert not store.replace("a", "r", {"response": {"status": "completed"}}, "in_progress")
    assert not store.replace("b", "r", {"response": {"status": "completed"}}, "cancelled")
    assert store.get("a", "r") == {"response": {"status": "cancelled"}}


def test_stream_events_are_appended_only_while_in_progress_and_read_past_a_sequence_number():
    store = MemoryResponseStore(max_bytes=10_000, max_age_s=3600)
    store.put("a", "r", {"response": {"status": "in_progress"}, "events": ["e0"], "alive_at": 1.0})
    assert store.append_events("a", "r", ["e1", "e2"], 5.0) and not store.append_events("b", "r", ["x"], 6.0)
    assert store.events_after("a", "r", 0) == {"status": "in_progress", "alive_at": 5.0, "events": ["e1", "e2"]}
    assert store.events_after("a", "r", -1)["events"] == ["e0", "e1", "e2"] and store.events_after("b", "r", -1) is None
    # the bound counts the record's JSON without its events and alive_at, plus the events' texts
    assert store.bytes == len('{"response":{"status":"in_progress"}}') + 6
    store.replace("a", "r", {"response": {"status": "completed"}, "events": ["e0", "e1", "e2", "e3"]}, "in_progress")
    assert not store.append_events("a", "r", ["late"], 7.0)
    assert store.events_after("a", "r", 2) == {"status": "completed", "alive_at": 0.0, "events": ["e3"]}


def test_a_flush_and_a_resumed_read_neither_parse_nor_write_the_record(monkeypatch):
    """A background reply flushes its new events five times a second and each resumed stream polls
    as often: those two calls touch the events list only, whatever the record's size, and an
    append that would pass the byte bound is refused with nothing changed."""
    from raylm.cluster import response_store

    store = MemoryResponseStore(max_bytes=200, max_age_s=3600)
    store.put("a", "r", {"response": {"status": "in_progress", "output": ["x" * 100]}, "events": []})
    before = store.bytes

    def no_json(*_args, **_kwargs):
        raise AssertionError("the record was parsed or written")

    monkeypatch.setattr(response_store.json, "dumps", no_json)
    monkeypatch.setattr(response_store.json, "loads", no_json)
    assert store.append_events("a", "r", ["e0", "e1"], 1.0)
    assert store.events_after("a", "r", -1) == {"status": "in_progress", "alive_at": 1.0, "events": ["e0", "e1"]}
    assert not store.append_events("a", "r", ["y" * 100], 2.0)  # past the 200-byte bound
    assert store.bytes == before + 4 and store.events_after("a", "r", 1)["events"] == []
    monkeypatch.undo()
    assert store.get("a", "r")["events"] == ["e0", "e1"] and store.get("a", "r")["alive_at"] == 1.0


def test_the_cluster_store_is_shared_by_replicas_and_outlives_them(serve_cluster):
    """Two router replicas' handles on the application's store actor: what one stores, the other
    reads (its owner only), also after the replica that created the actor is gone."""
    import ray

    from raylm.cluster.response_store import RayResponseStore

    @ray.remote(num_cpus=0)
    class Replica:  # stands in for a router replica: the first to ask creates the store actor
        def store(self, record: dict) -> bool:
            return RayResponseStore("store-test", 10_000, 3600).put("alice", "resp_1", record)

    replica = Replica.remote()
    assert ray.get(replica.store.remote(_record(5)))
    ray.kill(replica)
    other = RayResponseStore("store-test", 10_000, 3600)
    try:
        assert other.get("alice", "resp_1") == _record(5) and other.get("bob", "resp_1") is None
        assert other.delete("alice", "resp_1") and other.get("alice", "resp_1") is None
        other.put("alice", "resp_2", {"response": {"status": "in_progress"}, "events": []})
        assert other.append_events("alice", "resp_2", ["e0", "e1"], 2.0)
        assert other.events_after("alice", "resp_2", 0) == {"status": "in_progress", "alive_at": 2.0, "events": ["e1"]}
    finally:
        ray.kill(other._actor)
