"""hkserve: a JAX + dm-haiku LLM inference server.

Layers, lowest first (each imports only those below it; pyproject.toml's import-linter contracts
check this): model <- checkpoint <- engine <- api, multihost <- bench, train <- cli.
"""
