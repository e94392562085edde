"""The Ray Serve ingress: OpenAI HTTP API, priority/fairness queue and prefix-aware replica choice."""
