"""C kernels for the CPU, built on first use (see ``build``)."""
