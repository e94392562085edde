"""One model replica: scheduler, model runner, sampler, engine loop and the Ray Serve worker deployment."""
