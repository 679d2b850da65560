"""The chaos check: open-loop load, seeded faults, and a checker that counts every request."""
