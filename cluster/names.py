"""Names the Serve application's parts go by: the deployments are looked up by name from other
processes (``raylm status``, the ingress's replica poll, benchmarks), so each is declared once."""

DEFAULT_APP_NAME = "raylm"  # a deploy file's ``name`` when it gives none
WORKER_DEPLOYMENT = "LLMWorker"  # the replicas that stream (role both, or decode beside prefill replicas)
PREFILL_WORKER_DEPLOYMENT = "LLMPrefillWorker"  # a disaggregated app's prefill replicas (deploy file's prefill_workers)
ROUTER_DEPLOYMENT = "OpenAIRouter"
