"""The four deployable tokenbus processes: edge, ingest, scheduler, worker."""
