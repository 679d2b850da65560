"""`make upgrade-check`: a rolling upgrade to this checkout and back, under load."""
