"""The Beam plumbing every job shares: rolling part writers and the finalize step, progress
reported from workers, and Beam's local worker processes started quietly."""
