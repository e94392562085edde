"""The engine loop and its fronts: ``LLMEngine`` (step: schedule, run, process), the
``AsyncEngine`` thread for streaming, the offline ``LLM``, ``EngineArgs``, beam search."""
