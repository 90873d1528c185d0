"""hkserve: a JAX + dm-haiku LLM inference server.

Layers, lowest first (each imports only those below it; pyproject.toml's import-linter contracts
check this): kernels <- model <- checkpoint <- engine <- api, multihost <- bench, train <- cli.

- kernels/: C++ CPU kernels (XLA FFI) for int8/int4 weights and decode attention, and their dispatch.
- model/: pure JAX + Haiku models, memories, sampling, sharding rules.
- checkpoint/: GGUF / HF imports, the model store, tokenizers.
- engine/: the Engine (compiled prefill and decode), the InferenceRunner (continuous batching), and
  protocols.py, the interfaces between them and the API (ServingEngine, ServingRunner).
- api/: the OpenAI-compatible HTTP app (create_app; routes/ as APIRouters over a ServerContext).
- multihost/: one model across several hosts.
- bench/, train/: benchmarks and Transformer-VQ training.
- cli/: the `hkserve` command; flags become frozen options objects here.
"""
