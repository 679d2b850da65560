"""The `tokenbus` command: run a local deployment (`up`), its broker and its topics."""
