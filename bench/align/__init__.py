"""The align job and what it builds on: the alignment kernel (`alignment`), the Beam job's
stages (`beam_job`), corpus scale (`scale`), the job against the fastest tokenizing of the same
texts (`tokenize_gap`), conversations (`chat`) and the projection build (`projection_build`)."""
