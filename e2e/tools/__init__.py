"""Tools built from the Go module proxy for the chart checks (helm)."""
