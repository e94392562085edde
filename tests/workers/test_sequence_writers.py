"""Only the scheduler changes a sequence: no module but workers/core/scheduler.py, the block manager it
calls and workers/core/sequence.py itself writes a ``Sequence`` attribute (issue 32; vLLM v1's
``update_from_output``). The runner and the engine see plain data (``SchedulerOutput`` /
``RunnerOutput``) and a request's stream state lives in ``RequestState``.

A static scan of the packages a sequence can reach: it lives in a replica's engine
(``workers``, over ``cache`` and ``model``), and offline code (``deploy``'s benchmarks) holds
an engine too; the router and the cluster code only see the wire types, whose fields share
names (``text``, ``params``). Python has no types to go by, so a write counts when it targets
an attribute named like a ``Sequence`` field on anything but ``self`` (``x.field = ``,
``x.field += ``, ``setattr(x, "field", ...)``, ``x.field[i] = ``, ``x.field.append(...)`` and the
other list mutators), wherever ``x`` came from (``seq``, ``chunk.seq``, ``seqs[0]``). Calls
into a field's own object (``seq.embedding.add_chunk(...)``) are beyond it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from raylm.workers.core.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("model", "cache", "workers", "deploy")
# (workers/core/kv_loads.py: the scheduler's loads from KV offload tiers, called by it alone)
OWNERS = {"workers/core/scheduler.py", "cache/block_tables.py", "workers/core/sequence.py", "workers/core/kv_loads.py"}
FIELDS = frozenset(f.name for f in dataclasses.fields(Sequence))
MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__"})


def _receiver_name(node: ast.expr) -> str | None:
    """The name an object is reached by: ``seq`` for ``seq``, ``chunk.seq`` and ``seqs[0]``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _field_target(node: ast.expr) -> ast.Attribute | None:
    """``x.field`` (or ``x.field[...]``) when ``node`` writes a Sequence-named field of ``x``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        return node
    return None


def sequence_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) of every write to a Sequence-named attribute of an object other than ``self``."""
    found = []

    def check(target: ast.expr | None, line: int, how: str) -> None:
        attribute = _field_target(target) if target is not None else None
        if attribute is None:
            return
        name = _receiver_name(attribute.value)
        if name not in ("self", "cls"):
            found.append((line, f"{how} {ast.unparse(attribute)}"))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                    check(leaf, node.lineno, "assigns")
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check(node.target, node.lineno, "assigns")
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                check(target, node.lineno, "deletes")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                check(func.value, node.lineno, f"calls {func.attr} on")
            is_setattr = (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or (
                isinstance(func, ast.Attribute) and func.attr == "__setattr__")
            if is_setattr and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                if node.args[1].value in FIELDS and _receiver_name(node.args[0]) not in ("self", "cls"):
                    found.append((node.lineno, f"sets {node.args[1].value!r} of {ast.unparse(node.args[0])}"))
    return sorted(found)


def test_only_the_scheduler_writes_sequence_state():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in OWNERS:
                offenders += [f"{relative}:{line}: {what}" for line, what in sequence_writes(path.read_text())]
    assert offenders == [], "only workers/core/scheduler.py (and what it calls) may change a Sequence:\n" + \
        "\n".join(offenders)


@pytest.mark.parametrize("source, expected", [
    ("seq.draft_lag = 1", "assigns seq.draft_lag"),
    ("chunk.seq.num_computed_tokens += n", "assigns chunk.seq.num_computed_tokens"),
    ("seqs[0].embedding = e", "assigns seqs[0].embedding"),
    ("seq.finish_reason, seq.stop_reason = 'stop', s", "assigns seq.finish_reason"),
    ("seq.output_ids.append(t)", "calls append on seq.output_ids"),
    ("seq.block_ids[i] = fresh", "assigns seq.block_ids"),
    ("setattr(seq, 'text', t)", "sets 'text' of seq"),
    ("object.__setattr__(seq, 'status', s)", "sets 'status' of seq"),
])
def test_the_scan_finds_each_kind_of_write(source, expected):
    assert [what for _, what in sequence_writes(source)][:1] == [expected]


def test_the_scan_leaves_reads_and_own_fields_alone():
    source = "n = seq.num_tokens\nself.text = 'x'\nrow = seq.block_ids[0]\nout.samples[i] = []\nf(seq.output_ids)\n"
    assert sequence_writes(source) == []
