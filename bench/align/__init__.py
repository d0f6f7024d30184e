"""The align job and what it builds on: the alignment kernel, the projection build, corpus scale,
conversations, and the job against the fastest tokenizing of the same texts."""
