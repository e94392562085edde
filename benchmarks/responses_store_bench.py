"""What the Responses API's cluster store adds to a turn, measured on a served deploy file.

The deploy file is served on a private local Ray cluster (the store is then the application's
detached actor, as in production: cluster/response_store.py). A conversation of ``--turns``
turns is stored through ``/v1/responses``; then, alternating one at a time, the same next turn
is asked ``--requests`` times as

1. ``POST /v1/chat/completions`` with the whole conversation in ``messages``, and
2. ``POST /v1/responses`` with only the new question and ``previous_response_id`` (the router
   reads the conversation from the store and, with ``store`` on, writes the new record),

both greedy with ``max_tokens`` 1 and the same prompt (so both hit the prefix cache and differ
only in what the router does around generation). Printed: each one's p50 / p99 latency and the
differences, and the store actor's bytes per stored turn (its JSON records: each holds the
conversation so far, see docs/agents.md).

    python -m raylm.benchmarks.responses_store_bench [--config deploy/default.yaml] [--requests 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from raylm.benchmarks.serving_overhead import served_endpoint
from raylm.cluster.response_store import RayResponseStore
from raylm.deploy.config import load_deploy_config

QUESTIONS = ("Name a colour.", "And another one?", "Which of the two is darker?", "Name a fruit of that colour.",
             "Is it sweet?", "What else is?")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed(client: httpx.Client, path: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    response = client.post(path, json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response.json()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/default.yaml")
    parser.add_argument("--turns", type=int, default=4, help="turns stored before the measured one")
    parser.add_argument("--requests", type=int, default=200, help="measured requests of each kind")
    parser.add_argument("--port", type=int, default=8021)
    args = parser.parse_args(argv)
    config = load_deploy_config(args.config)
    model = config.served_model_name
    with served_endpoint(config, args.port) as base:
        from raylm.deploy.readiness import wait_healthy

        wait_healthy(base)
        client = httpx.Client(base_url=base, timeout=120)
        messages: list[dict] = []
        previous = None
        for turn in range(args.turns):
            question = QUESTIONS[turn % len(QUESTIONS)]
            body = {"model": model, "input": question, "max_output_tokens": 16, "temperature": 0}
            if previous:
                body["previous_response_id"] = previous
            _, record = _timed(client, "/v1/responses", body)
            previous = record["id"]
            answer = "".join(part["text"] for item in record["output"] if item["type"] == "message"
                             for part in item["content"])
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        held, records = RayResponseStore(config.name, 0, 0).held()  # (the app's actor, found by name)
        question = QUESTIONS[args.turns % len(QUESTIONS)]
        chat_body = {"model": model, "messages": [*messages, {"role": "user", "content": question}],
                     "max_tokens": 1, "temperature": 0}
        responses_body = {"model": model, "input": question, "previous_response_id": previous,
                          "max_output_tokens": 1, "temperature": 0}
        for _ in range(5):  # warm: compile the shapes, cache the prefix
            _timed(client, "/v1/chat/completions", chat_body)
            _timed(client, "/v1/responses", {**responses_body, "store": False})
        chat, stored, unstored = [], [], []
        for _ in range(args.requests):
            chat.append(_timed(client, "/v1/chat/completions", chat_body)[0])
            stored.append(_timed(client, "/v1/responses", responses_body)[0])
            unstored.append(_timed(client, "/v1/responses", {**responses_body, "store": False})[0])
    print(f"{model}, {args.turns} stored turns then one more, {args.requests} requests each (alternating)")
    print(f"{'request':<42}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}")
    base50, base99 = statistics.median(chat), _percentile(chat, 0.99)
    for name, times in (("chat completion, whole conversation", chat),
                        ("responses, previous_response_id, store", stored),
                        ("responses, previous_response_id, no store", unstored)):
        p50, p99 = statistics.median(times), _percentile(times, 0.99)
        print(f"{name:<42}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}{(p50 - base50) * 1e3:>9.2f}{(p99 - base99) * 1e3:>9.2f}")
    print(f"store after {args.turns} turns: {records} records, {held} bytes of JSON "
          f"({held / max(records, 1):.0f} B per record; turn n's record holds the n turns so far)")


if __name__ == "__main__":
    main()
