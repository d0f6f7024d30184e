"""The Beam plumbing every job shares: tagged outputs and dead letters, rolling writers and the
finalize step, progress, storage, job defaults, quiet local workers. The jobs import it, never
each other.
"""
