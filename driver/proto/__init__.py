"""Generated gRPC code for the kubelet plugin protocols (see generate.sh).

The `.proto` files are copies of the kubelet's with the upstream package names, so
the gRPC method paths match what the real kubelet calls.
"""
