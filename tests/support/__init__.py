"""Test support: real servers started on free loopback ports, stopped by their PIDs."""
