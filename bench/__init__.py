"""Load generation and the benchmark report: `tokenbus bench` and `make bench`."""
