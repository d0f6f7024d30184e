"""Conversations (chat data): rows -> each model's own chat template -> aligned token arrays.

Each side renders a conversation with its own template; the message contents, the same text in
every rendering, are located and aligned, and turn markers are paired by message, never by text
(docs/alignment.md, "Conversations"). `align.align_conversations` is the entry point.
"""
