"""The kind cluster provider for the end-to-end suite (`make e2e-kind`, needs Docker)."""
