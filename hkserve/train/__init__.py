"""Training hkserve models from text: config, tokenizer training, data streams, the jitted update,
orbax checkpoints, evaluation in bits per byte, and export into the model store."""
