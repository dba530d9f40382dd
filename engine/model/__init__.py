"""The Llama-family model: config, weights (safetensors, GGUF), export, and the loader."""
