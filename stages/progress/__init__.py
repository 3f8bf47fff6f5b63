"""The `progress` stage: per-iteration series for DVC plots, the summary table and the TensorBoard view."""
