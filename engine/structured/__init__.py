"""Grammar-constrained decoding: specs, compiled grammars, per-request matchers, token masks."""
