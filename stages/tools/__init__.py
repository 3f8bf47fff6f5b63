"""Tools around the pipeline: artifact inspection, the multi-run report, the in-process chain and the
comparison runner. They may import stages; no stage imports them (tests/test_layout.py)."""
