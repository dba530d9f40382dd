"""The OpenAI Batch API: its routes, the runner that works a batch off, and its results file."""
