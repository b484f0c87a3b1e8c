"""Plumbing shared by the driver and the webhook: the API client and atomic files."""
