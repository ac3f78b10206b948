"""The `delta-attention` command line and the benchmarks."""
