"""`make gpu-check` and the sections only a GPU measures (kept from their last GPU run elsewhere)."""
