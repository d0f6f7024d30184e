"""`make gpu-check` (`check`, its parts in `check_cases` and `check_train`, reruns merged by
`check_merge`), the folder a bare GPU machine needs (`pack`), and the two sections only a GPU
measures (`section`, `channel_cuda`), kept from their last GPU run elsewhere."""
