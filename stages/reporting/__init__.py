"""Reporting shared by the pipeline's last steps: per-iteration progress series and experiment reports."""
