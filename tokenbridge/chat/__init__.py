"""Conversations (chat data): rows -> each model's own chat template -> aligned token arrays.

Read in this order: `rows` (formats, parsing, dead-letter reasons), `templates` (where a
template comes from, the shipped ones, the rendering call), `render` (content spans in a
rendering), `encode` (tokenizing a rendering), `markers` (turn markers and content tokens per
side), `train` (train flags), `align` (the batch entry point, `align_conversations`).
`example` writes the shipped example conversations.
"""
