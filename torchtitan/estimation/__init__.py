"""Memory estimator engine: fake process group + FakeTensorMode + live-memory tracking."""
