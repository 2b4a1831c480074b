"""Model architectures, their config reader, weight loader and registry."""
