"""Plumbing shared by the driver and the webhook: the API client, the list/watch and
reconcile loops every controller runs on, retry backoff, and atomic files."""
