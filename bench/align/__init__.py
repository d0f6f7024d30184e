"""The align job and what it builds on: the alignment kernel (`alignment`), the Beam job's
stages (`beam_job`), corpus scale (`scale`), conversations (`chat`) and the projection build
(`projection_build`)."""
