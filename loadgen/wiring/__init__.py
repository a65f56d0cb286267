"""Locust integration: the load context a run shares, the event hooks, the web UI's kvbench
tab, and the sessions built ahead of their users."""
