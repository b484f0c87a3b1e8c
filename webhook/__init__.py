"""HTTPS admission webhook: legacy GPU pod conversion, tenant limits, config validation."""
