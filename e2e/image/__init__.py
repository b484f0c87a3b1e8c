"""Builds the gpudra image without a container engine (`make image`)."""
