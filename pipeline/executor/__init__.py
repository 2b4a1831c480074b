"""Executors and hosts: what drives the ranks (this host, other hosts, Ray actors)."""
