"""The engine's core, as plain data and host logic (no JAX): requests and sequences, the
scheduler, a step's plan and result, sampling parameters, grammars, LoRA adapter bookkeeping
and the engine's counters."""
