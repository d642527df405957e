"""One-question measurements, kept because the question may come back (README.md: each one's
question, answer and commit). Not what a user runs: bench/ holds that."""
