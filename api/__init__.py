"""Kubernetes resource.k8s.io objects and gpudra opaque device configs."""
