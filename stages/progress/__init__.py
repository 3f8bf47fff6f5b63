"""The `progress` stage: per-iteration series for DVC plots, the summary table and the TensorBoard view; the
`headline` stage: artifacts/metrics.json, the last iteration's row (the one DVC metric)."""
