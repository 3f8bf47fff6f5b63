"""Benchmarks (`smdctl bench ...`) and the synthetic rollouts they and the tests use. No DVC stage runs them,
so editing a bench reruns nothing (tests/test_dvc_deps.py)."""
