"""What every room uses: the TF_* settings, structlog set-up, progress bars and log lines."""
