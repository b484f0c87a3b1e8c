"""Per-node agent: NVML discovery, ResourceSlice publishing and the kubelet plugin."""
