"""The building blocks the loss modes share: chunk segments, CP-aware chunk sums, fused
student-side reductions, row-blocked maps, the conversation train mask,
and the projection tables `xtoken` reads."""
