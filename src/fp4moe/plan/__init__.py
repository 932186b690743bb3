"""Planning before running: cross-compilation of kernels for any target (issue 4 grows this)."""
