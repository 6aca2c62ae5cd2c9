"""SGLang rollout engines: ``server`` (launch, health, shutdown of a real SGLang server),
``client`` (token-in/token-out generation and the weight-update API over HTTP),
``weight_sender`` (bucketed trainer->engine weight sync, independent of the trainer), and
``cpu_standins`` (what SGLang needs to run on a machine without CUDA)."""
