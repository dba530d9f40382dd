"""Attention over the paged KV cache: the step's page table and the backends that read it."""
