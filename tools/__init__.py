"""Command-line tools kept with the repository (the real-text workload builder)."""
