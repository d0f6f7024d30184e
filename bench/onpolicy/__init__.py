"""On-policy distillation: the section (`section`: sampler, FSDP2 gathering, the step's
phases, TRL's GOLDTrainer next to ours) and its parts, and the equal-budget comparison of
``make demo-onpolicy-compare`` (`equal_budget`)."""
