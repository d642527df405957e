"""The benchmarks a user runs (not tests): docs/performance.md says what each measures and how to
run it; bench/experiments/ holds one-question measurements (its README says which)."""
