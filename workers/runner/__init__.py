"""Runs a step's plan on the device: the model runner, its compiled programs, batch assembly,
the on-device sampler, speculative decoding's step and the draft model, grammar masks."""
