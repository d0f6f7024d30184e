"""The science table (``make science``): its runs, statistics, Markdown and TRL's GOLD loss."""
